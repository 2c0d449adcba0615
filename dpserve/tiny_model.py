"""A deterministic tiny Llama that vLLM's CPU backend can serve.

The gateway's tests and benchmarks need real vLLM replicas but no model download: this module builds a
2-layer Llama with random weights and a locally trained byte-level BPE tokenizer. Its output is noise,
which is fine: what matters is that prompts tokenize, prefixes share KV blocks, and generation costs
little CPU time.

torch, transformers and tokenizers are imported inside functions so that importing this module (e.g.
from the router, for TINY_MODEL_NAME) stays fast and works without them installed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TINY_MODEL_NAME = "dpserve-tiny"

# Bump whenever the build output changes, so cached copies under an old name are not reused.
BUILD_VERSION = 1

VOCAB_SIZE = 512
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]

# Shapes chosen for vLLM CPU: its attention rejects head_dim 16 but accepts 64.
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
HEAD_DIM = 64
MAX_POSITION_EMBEDDINGS = 4096

# Role markers are plain text (split into byte-level pieces) so the vocabulary needs no extra tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Fixed training corpus: varied English prose, dialogue, code-ish text and numbers, so the 512-token
# vocabulary learns common English merges. Editing it changes the tokenizer: bump BUILD_VERSION.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness. Call me Ishmael. Some years ago, never mind how long precisely, having little or no money
in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and
see the watery part of the world.

In the beginning the river was small, and the village beside it was smaller still. Every morning the
fishermen pushed their boats into the water and every evening they came home with baskets of silver
fish. The children ran along the bank, shouting and laughing, while their parents mended nets and
talked about the weather, the harvest, and the price of bread in the market town across the hills.

User: Can you tell me how to bake a loaf of bread?
Assistant: Of course. Mix flour, water, salt and yeast into a dough. Knead it for ten minutes, let it
rise for an hour, shape it, let it rise again, and bake it in a hot oven for about forty minutes.
User: What temperature should the oven be?
Assistant: Around two hundred and twenty degrees Celsius works well for most simple loaves.
User: Thank you! What is the capital of France?
Assistant: The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum, and
its many cafes along the river Seine.
User: Please summarize the following paragraph in one sentence.
Assistant: Here is a short summary of the paragraph you provided.

Data parallel inference runs several copies of the same model, each on its own device, and a router
sends every request to one of them. A good router balances the load so that no replica sits idle while
another has a long queue. It can also try to send requests that share a prompt prefix to the same
replica, because that replica may still hold the key and value cache for the prefix, which saves
compute and lowers the time to the first token. Throughput, latency, and fairness all matter.

def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i, i ** 3)

class Request:
    def __init__(self, prompt, max_tokens=16):
        self.prompt = prompt
        self.max_tokens = max_tokens

{"model": "tiny", "prompt": "Hello, world", "max_tokens": 32, "temperature": 0.0, "stream": true}
GET /health HTTP/1.1 200 OK; POST /v1/completions; POST /v1/chat/completions; GET /metrics

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 20 24 32 48 64 100 128 256 512 1000 1024 2048 4096 65536.
Dates: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March,
April, May, June, July, August, September, October, November, December. The meeting is at 3:30 pm.

Science tells us that water boils at one hundred degrees at sea level, that light travels faster than
sound, and that the earth goes around the sun once every year. Plants turn sunlight, water and carbon
dioxide into sugar and oxygen. The human heart beats about one hundred thousand times each day.

She opened the door slowly and looked inside. The room was quiet, the windows were open, and a warm
breeze moved the curtains. On the table there was a letter, a cup of cold tea, and an old photograph
of two people standing in front of a house by the sea. "Where did everyone go?" she asked, but nobody
answered. He said, "I don't know, but I'm sure they'll be back soon." They waited, and they wondered.

Questions people often ask: What time is it? How does this work? Why is the sky blue? Who wrote this
book? Where is the nearest station? When does the store open? Which one should I choose, and why?
Answers are usually simpler than we expect, although sometimes they are much harder to find.

Instructions: First, read the whole document carefully. Second, write down the main ideas. Third,
check each idea against the evidence. Finally, write a clear and short report that explains what you
found, what you could not find, and what you would do next if you had more time and more information.
"""


def train_tokenizer() -> Tokenizer:
    """Train a byte-level BPE on the embedded corpus (no download, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        # Seed all 256 bytes so any input text (any language, emoji) stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One line per "document"; for identical input the trainer's merge order (ties included) is fixed.
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Prepend BOS like Llama tokenizers do, so completions prompts look like what the model "expects".
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def _normalize_json(path: Path) -> None:
    """Rewrite a JSON file with sorted keys so its bytes do not depend on dict insertion order."""
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _save_tokenizer(target: Path) -> tuple[int, int, int, int]:
    """Save the tokenizer; return (vocab size, bos id, eos id, pad id) for the model config."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json (one file to inspect).
    hf_tokenizer.save_pretrained(target, save_jinja_files=False)
    # transformers 5 writes "TokenizersBackend", which transformers 4 (e.g. in another router's env)
    # cannot resolve; "PreTrainedTokenizerFast" loads in both.
    config_path = target / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config), encoding="utf-8")
    return (
        len(hf_tokenizer),
        hf_tokenizer.bos_token_id,
        hf_tokenizer.eos_token_id,
        hf_tokenizer.pad_token_id,
    )


def _save_model(target: Path, seed: int, vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> None:
    """Save config, seeded random float32 weights (safetensors) and the generation config."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    # fork_rng: seed a private RNG state instead of changing the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    model.save_pretrained(target, safe_serialization=True)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(target)


def build_tiny_model(target: Path, seed: int = 0) -> Path:
    """Build the tiny model into ``target`` (created if missing) and return it.

    Two builds with the same seed and library versions produce byte-identical files.
    """
    from transformers.utils import logging as hf_logging

    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    # The "Writing model shards" bar is noise in a launcher's log; restore the caller's setting after.
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        vocab_size, bos_id, eos_id, pad_id = _save_tokenizer(target)
        _save_model(target, seed, vocab_size, bos_id, eos_id, pad_id)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    for path in target.iterdir():
        # Sorted keys: byte-identity must not hinge on how a transformers version orders its dicts.
        if path.suffix == ".json":
            _normalize_json(path)
        # safetensors arrive 0600 (written via a temp file); make every file world-readable alike.
        path.chmod(0o644)
    return target


def ensure_tiny_model(cache_dir: Path) -> Path:
    """Return ``cache_dir / tiny-v{BUILD_VERSION}``, building it first if it is missing.

    The model is built in a temporary sibling folder and renamed into place, so a reader never sees a
    half-built folder; if two callers race, the loser's rename fails and it uses the winner's copy.
    """
    cache_dir = Path(cache_dir)
    final = cache_dir / f"tiny-v{BUILD_VERSION}"
    if _is_complete(final):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        build_tiny_model(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the final folder should be readable like any other
        try:
            # os.rename of a directory fails if the destination exists and is non-empty: that is the
            # "someone else finished first" signal, and never overwrites a folder a reader may be using.
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_complete(path: Path) -> bool:
    """A model folder only appears by rename after a full build, so presence of its files suffices."""
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()
