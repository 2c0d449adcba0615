"""Tests for the tiny model's LoRA adapters (needs torch/transformers/peft; skipped without them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from dpserve import tiny_lora
from dpserve.cli import main
from dpserve.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built once per module: a couple of seconds on CPU.
    return build_tiny_model(tmp_path_factory.mktemp("tiny-base"))


@pytest.fixture(scope="module")
def built(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("loras")
    assert main(["model", "tiny-lora", str(out), "--count", "2", "--base", str(base)]) == 0
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _lora_tensors(adapter: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return dict(load_file(adapter / "adapter_model.safetensors"))


def test_cli_builds_named_adapters_and_prints_them(built: Path, base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(p.name for p in built.iterdir()) == ["tiny-lora-0", "tiny-lora-1"]
    for adapter in built.iterdir():
        assert {"adapter_config.json", "adapter_model.safetensors", tiny_lora.MARKER} <= set(_files(adapter))
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA"
        assert config["r"] == 8
        assert config["target_modules"] == ["q_proj", "v_proj"]
        # vLLM's filesystem resolver compares this with the served --model.
        assert config["base_model_name_or_path"] == str(base.absolute())
    # The second run finds both current: it prints them again and rewrites nothing.
    before = {p: p.stat().st_mtime_ns for p in built.rglob("*")}
    assert main(["model", "tiny-lora", str(built), "--count", "2", "--base", str(base)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(built / "tiny-lora-0"), str(built / "tiny-lora-1")]
    assert {p: p.stat().st_mtime_ns for p in built.rglob("*")} == before


def test_builds_are_byte_identical(built: Path, base: Path, tmp_path: Path) -> None:
    again = tiny_lora.build_tiny_loras(tmp_path, base, count=2)
    assert again == [tmp_path / "tiny-lora-0", tmp_path / "tiny-lora-1"]
    assert _files(tmp_path) == _files(built)


def test_weights_are_random_and_differ_between_adapters(built: Path) -> None:
    import torch

    first, second = (_lora_tensors(built / name) for name in ("tiny-lora-0", "tiny-lora-1"))
    assert sorted(first) == sorted(second)
    # 2 layers x (q_proj, v_proj) x (A, B)
    assert len(first) == 8
    lora_b = [name for name in first if "lora_B" in name]
    assert len(lora_b) == 4
    for name in lora_b:
        assert first[name].abs().min() > 0, f"{name} has zeros: an all-zero lora_B is a no-op"
    for name in first:
        assert not torch.equal(first[name], second[name]), name


def test_adapters_change_the_model_output(built: Path, base: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    logits = []
    for name in (None, "tiny-lora-0", "tiny-lora-1"):
        model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
        if name:
            model = PeftModel.from_pretrained(model, built / name)
        with torch.no_grad():
            logits.append(model(ids).logits[0, -1])
    plain, first, second = logits
    assert not torch.allclose(plain, first)
    assert not torch.allclose(first, second)


def test_stale_adapter_is_rebuilt(built: Path, base: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "tiny-lora-0"
    tiny_lora.build_tiny_loras(tmp_path, base, count=1, seed=5)
    other_seed = (adapter / "adapter_model.safetensors").read_bytes()
    # Other inputs (seed): rebuilt, to the same bytes as a fresh build with these.
    tiny_lora.build_tiny_loras(tmp_path, base, count=1, seed=0)
    assert (adapter / "adapter_model.safetensors").read_bytes() != other_seed
    assert _files(adapter) == _files(built / "tiny-lora-0")
    # An older build version (here with a damaged weights file): rebuilt too.
    marker = adapter / tiny_lora.MARKER
    marker.write_text(marker.read_text().replace(f'"build_version": {tiny_lora.BUILD_VERSION}', '"build_version": 0'))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    tiny_lora.build_tiny_loras(tmp_path, base, count=1, seed=0)
    assert _files(adapter) == _files(built / "tiny-lora-0")
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-lora-0"]  # no temporary folder left behind


def test_rejects_bad_arguments(base: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="count"):
        tiny_lora.build_tiny_loras(tmp_path, base, count=-1)
    with pytest.raises(ValueError, match="rank"):
        tiny_lora.build_tiny_loras(tmp_path, base, count=1, rank=0)
