"""Deterministic LoRA adapters for the tiny model, for tests and demos of LoRA routing.

Each adapter is a peft LoRA (``q_proj``/``v_proj``) on the tiny Llama of dpserve.tiny_model, with every
weight drawn from a generator seeded by (seed, index). peft itself starts ``lora_B`` at zero, which makes
an adapter a no-op; here both matrices are random, so different adapters give different outputs.

torch, transformers and peft are imported inside functions, like dpserve.tiny_model. This module imports
nothing from dpserve (so it sits in the lowest layer beside tiny_model): the caller passes the base model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Bump whenever the build output changes, so adapters built by an older version are rebuilt.
BUILD_VERSION = 1

NAME_PREFIX = "tiny-lora"
DEFAULT_RANK = 8
TARGET_MODULES = ("q_proj", "v_proj")
# Standard deviation of both LoRA matrices. With lora_alpha = rank (scaling 1), B @ A has entries of
# about sqrt(rank) * 0.1 * 0.1 ~ 0.03, like the base weights (std 0.02): enough to change greedy output.
WEIGHT_STD = 0.1
# Written beside peft's files; an adapter folder whose marker matches is not rebuilt.
MARKER = "dpserve-build.json"


def adapter_name(index: int) -> str:
    return f"{NAME_PREFIX}-{index}"


def _adapter_seed(seed: int, index: int) -> int:
    """A torch seed per (seed, index): hashed, so (0, 1) and (1, 0) do not collide."""
    digest = hashlib.sha256(f"{NAME_PREFIX}:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def _normalize_json(path: Path) -> None:
    """Rewrite a JSON file with sorted keys so its bytes do not depend on dict insertion order."""
    data = json.loads(path.read_text(encoding="utf-8"))
    # peft keeps target_modules as a set, whose order follows PYTHONHASHSEED.
    if isinstance(data, dict) and isinstance(data.get("target_modules"), list):
        data["target_modules"] = sorted(data["target_modules"])
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _marker(seed: int, index: int, rank: int, base: str) -> dict[str, Any]:
    return {"build_version": BUILD_VERSION, "seed": seed, "index": index, "rank": rank, "base_model": base}


def _is_current(path: Path, marker: dict[str, Any]) -> bool:
    """Built by this version with the same inputs (the marker is written last, so also complete)."""
    try:
        found = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(found == marker and (path / "adapter_model.safetensors").is_file())


def _peft_model(base: str, rank: int) -> Any:
    """The base model wrapped by peft, once for all adapters (each one only overwrites the LoRA weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=rank,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
        bias="none",
        task_type="CAUSAL_LM",
    )
    # fork_rng: peft's own (discarded) initialisation must not move the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        peft_model = get_peft_model(model, config)
    peft_model.eval()
    return peft_model


def _randomize(peft_model: Any, seed: int) -> None:
    """Overwrite every lora_A and lora_B, in a fixed (sorted) order, from a generator seeded by ``seed``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    params = sorted((name, p) for name, p in peft_model.named_parameters() if ".lora_A." in name or ".lora_B." in name)
    if not params:
        raise RuntimeError("peft created no LoRA weights: are the target modules in the base model?")
    with torch.no_grad():
        for _, param in params:
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * WEIGHT_STD
            param.copy_(values.to(param.dtype))


def _save(peft_model: Any, target: Path, marker: dict[str, Any]) -> None:
    peft_model.save_pretrained(target, safe_serialization=True)
    # peft's model-card template (5 KB of "More Information Needed"): nothing reads it.
    (target / "README.md").unlink(missing_ok=True)
    for path in target.iterdir():
        # Sorted keys: byte-identity must not hinge on how a peft version orders its dicts.
        if path.suffix == ".json":
            _normalize_json(path)
        path.chmod(0o644)
    # Last, so a folder with a matching marker is a finished one.
    (target / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (target / MARKER).chmod(0o644)


def build_tiny_loras(
    target_dir: Path, base_model: Path, count: int, seed: int = 0, rank: int = DEFAULT_RANK
) -> list[Path]:
    """Build adapters ``tiny-lora-0`` … ``tiny-lora-{count-1}`` under ``target_dir``; return their folders.

    ``base_model`` is the tiny model's folder; adapter_config.json names it (absolute) as
    base_model_name_or_path, which vLLM's filesystem LoRA resolver compares with the served ``--model``.
    An adapter already built by this BUILD_VERSION with the same inputs is kept as is. Two builds with the
    same inputs and library versions produce byte-identical files.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, not {count}")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, not {rank}")
    target_dir = Path(target_dir)
    base = str(Path(base_model).absolute())
    paths = [target_dir / adapter_name(i) for i in range(count)]
    todo = [i for i in range(count) if not _is_current(paths[i], _marker(seed, i, rank, base))]
    if not todo:
        return paths

    from transformers.utils import logging as hf_logging

    target_dir.mkdir(parents=True, exist_ok=True)
    # "Loading weights" bars are noise in a launcher's log; restore the caller's setting after.
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        peft_model = _peft_model(base, rank)
        for index in todo:
            _build_one(peft_model, paths[index], _adapter_seed(seed, index), _marker(seed, index, rank, base))
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    return paths


def _build_one(peft_model: Any, final: Path, torch_seed: int, marker: dict[str, Any]) -> None:
    """Build in a temporary sibling and rename into place, so a reader never sees a half-built adapter."""
    _randomize(peft_model, torch_seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _save(peft_model, tmp, marker)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        if final.exists():
            # Stale (another version or other inputs): replace it.
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else built it at the same time: fine if theirs is current.
            if not _is_current(final, marker):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
