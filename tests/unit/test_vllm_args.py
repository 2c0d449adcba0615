"""The flags after `--`, read in every spelling vLLM's own parser accepts (`up/vllm_args.py`)."""

from __future__ import annotations

import pytest

from dpserve.deploy.kube_options import KubeOptions
from dpserve.up.plan import told_max_num_seqs
from dpserve.up.vllm_args import flag_name, given, listed, value_of


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--max-num-seqs", "4"), "4"),
        (("--max-num-seqs=4",), "4"),
        (("--max_num_seqs", "6"), "6"),
        (("--max_num_seqs=6",), "6"),
        (("--max-num-s", "7"), "7"),  # an abbreviation, as argparse takes it
        (("--max-num-seqs", "4", "--dtype", "half", "--max-num-seqs", "9"), "9"),  # the last given wins
        (("--max-num-batched-tokens", "4096"), None),  # another flag, not a longer spelling of this one
        (("--dtype", "half"), None),
        (("--max-num-seqs",), None),
        (("--max-num-seqs", "--dtype", "half"), None),
    ],
)
def test_a_flags_value_is_read_as_vllm_reads_it(args: tuple[str, ...], expected: str | None) -> None:
    assert value_of(args, "--max-num-seqs") == expected


def test_the_routers_told_batch_limit_reads_every_spelling() -> None:
    assert told_max_num_seqs(("--max_num_seqs=12", "--enforce-eager")) == 12
    assert told_max_num_seqs(("--max-num-seqs", "0")) is None


def test_a_flag_given_in_any_spelling_is_given() -> None:
    assert given(("--enable_prefix_caching",), "--enable-prefix-caching")
    assert given(("--served-model", "m"), "--served-model-name")
    assert given(("-tp", "2"), "--tensor-parallel-size", "-tp")
    assert not given(("--enable-lora-bias",), "--enable-lora")
    assert not given(("x", "--enable-lora"), "--max-loras")
    assert flag_name("--max_model_len=8") == "--max-model-len" and flag_name("8") == ""
    assert listed("--max-model", {"--max-model-len": "x"}) == "--max-model-len"


def test_the_served_model_is_the_last_flags_first_name() -> None:
    options = KubeOptions(replicas=1, vllm_args=("--served-model-name", "a", "--served_model_name", "b", "alias"))
    assert options.served_model == "b"
    assert KubeOptions(replicas=1).served_model == options.model
