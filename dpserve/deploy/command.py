"""`dpserve compose`: write the Compose stack (or one of its overrides) for N GPUs."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpserve.deploy.compose import DEFAULT_GPUS, DEFAULT_MODEL, ComposeOptions, render
from dpserve.deploy.env_file import read_env_file


def compose_options(
    gpus: int | None,
    model: str | None,
    env: Mapping[str, str],
    scaled: bool = False,
    routers: int = 1,
    router_workers: int = 1,
    **given: Any,
) -> ComposeOptions:
    """Flags win; then GPUS, MODEL and LORA_DIR from the env file (the `.env` docker compose reads too); then
    defaults. `given`: ComposeOptions' LoRA and tracing fields given as flags."""
    if gpus is None:
        raw = env.get("GPUS", str(DEFAULT_GPUS))
        if not raw.isdigit():
            raise ValueError(f"GPUS={raw!r} in the env file is not a whole number")
        gpus = int(raw)
    model = model or env.get("MODEL") or DEFAULT_MODEL
    if given.get("lora_dir") is None and env.get("LORA_DIR"):
        given["lora_dir"] = env["LORA_DIR"]
    return ComposeOptions(
        gpus=gpus, model=model, scaled=scaled, routers=routers, router_workers=router_workers, **given
    )


def run_compose(
    gpus: int | None,
    model: str | None,
    overlay: str | None,
    output: Path | None,
    env_file: Path | None,
    scaled: bool = False,
    routers: int = 1,
    router_workers: int = 1,
    **given: Any,
) -> int:
    try:
        env = read_env_file(env_file) if env_file and env_file.is_file() else {}
        options = compose_options(gpus, model, env, scaled, routers, router_workers, **given)
    except ValueError as exc:
        print(f"dpserve compose: {exc}", file=sys.stderr)
        return 2
    if overlay is None and env.get("MODEL", options.model) != options.model:
        # compose.yaml says ${MODEL:-<model>}: the env file's MODEL is what docker compose will serve.
        print(
            f"dpserve compose: note: {env_file} sets MODEL={env['MODEL']}, which docker compose serves instead "
            f"of {options.model}; change it there too",
            file=sys.stderr,
        )
    if overlay is None and options.lora_dir and env.get("LORA_DIR") and env["LORA_DIR"] != options.lora_dir:
        # Likewise ${LORA_DIR:-<folder>}: the env file's LORA_DIR is the folder docker compose mounts.
        print(
            f"dpserve compose: note: {env_file} sets LORA_DIR={env['LORA_DIR']}, which docker compose mounts "
            f"instead of {options.lora_dir}; change it there too",
            file=sys.stderr,
        )
    try:
        text = render(options, overlay)
    except ValueError as exc:  # an override that cannot take what was given (vLLM flags for sim replicas)
        print(f"dpserve compose: {exc}", file=sys.stderr)
        return 2
    if output is None:
        sys.stdout.write(text)
        return 0
    output.write_text(text)
    what = f"{options.gpus} {overlay} replica(s)" if overlay else f"{options.gpus} GPU(s), {options.model}"
    if options.tensor_parallel_size > 1:
        what += f", {options.replicas} replica(s) of {options.tensor_parallel_size} GPUs"
    if options.routers > 1:
        what += f", {options.routers} routers"
    print(f"dpserve compose: wrote {output} ({what})", file=sys.stderr)
    return 0
