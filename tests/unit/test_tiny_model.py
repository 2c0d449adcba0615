"""Tests for the deterministic tiny Llama builder (needs torch/transformers; skipped without them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from dpserve import tiny_model as tiny


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built once per module: each build takes a couple of seconds on CPU.
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny-a"))


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_builds_are_byte_identical(built: Path, tmp_path: Path) -> None:
    again = tiny.build_tiny_model(tmp_path / "tiny-b")
    first, second = _files(built), _files(again)
    assert sorted(first) == sorted(second)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(first)
    for name in first:
        assert first[name] == second[name], name


def test_seed_changes_weights(built: Path, tmp_path: Path) -> None:
    other = tiny.build_tiny_model(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (built / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (built / "tokenizer.json").read_bytes()


def test_config_values(built: Path) -> None:
    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 2
    assert config["hidden_size"] == 128
    assert 256 <= config["intermediate_size"] <= 512
    assert config["num_attention_heads"] == 2
    assert config["num_key_value_heads"] == 1
    assert config["head_dim"] == 64  # vLLM CPU attention rejects head_dim 16
    assert config["max_position_embeddings"] == 4096
    assert config["vocab_size"] == tiny.VOCAB_SIZE
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    generation = json.loads((built / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_tokenizer_round_trip(built: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    assert len(tok) == tiny.VOCAB_SIZE
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (tiny.BOS_TOKEN, tiny.EOS_TOKEN, tiny.PAD_TOKEN)
    for text in ["Hello, world!", "The quick brown fox.\n  Indented line\tand tab", "ünïcödé ✓ 数字 42"]:
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    # Merges were learned: common English compresses below one token per byte.
    text = "The capital of France is Paris, and the river is the Seine."
    assert len(tok(text, add_special_tokens=False).input_ids) < len(text.encode()) // 2


def test_chat_template(built: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    with_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert with_prompt.startswith(tiny.BOS_TOKEN)
    assert "<|system|>\nBe brief." in with_prompt
    assert "<|user|>\nWhat is the capital of France?" in with_prompt
    assert with_prompt == without + "<|assistant|>\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids["input_ids"][0] == tok.bos_token_id
    # OpenAI-style content parts render like a plain string.
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == tok.apply_chat_template([messages[1]], tokenize=False)


def test_ensure_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    real_build = tiny.build_tiny_model

    def counting_build(target: Path, seed: int = 0) -> Path:
        calls.append(target)
        return real_build(target, seed)

    monkeypatch.setattr(tiny, "build_tiny_model", counting_build)
    first = tiny.ensure_tiny_model(tmp_path / "cache")
    assert first == tmp_path / "cache" / f"tiny-v{tiny.BUILD_VERSION}"
    assert (first / "model.safetensors").is_file()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = tiny.ensure_tiny_model(tmp_path / "cache")
    assert second == first
    assert len(calls) == 1
    assert (second / "model.safetensors").stat().st_mtime_ns == mtime
    # No temporary build folders are left behind.
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]


def test_ensure_loses_race_gracefully(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate another process finishing first, between our completeness check and our rename.
    cache = tmp_path / "cache"
    final = cache / f"tiny-v{tiny.BUILD_VERSION}"
    real_build = tiny.build_tiny_model

    def racing_build(target: Path, seed: int = 0) -> Path:
        real_build(final, seed)
        (final / "winner").write_text("x")
        return real_build(target, seed)

    monkeypatch.setattr(tiny, "build_tiny_model", racing_build)
    assert tiny.ensure_tiny_model(cache) == final
    assert (final / "winner").is_file()  # the winner's folder was kept, not overwritten
    assert [p.name for p in cache.iterdir()] == [final.name]
