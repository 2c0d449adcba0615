"""tools/pip-args.sh, the pip arguments of `make run` and `make test`: the torch index added for the CPU engine
where it answers, left out, saying so and within seconds, where it does not."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.conftest import torch_index

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--timeout", "20", "--retries", "2"]


def _pip_args(engine: str, index: str) -> tuple[list[str], str, float]:
    started = time.monotonic()
    result = subprocess.run(
        ["tools/pip-args.sh", engine],
        cwd=ROOT,
        env={**os.environ, "TORCH_INDEX": index},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.split(), result.stderr, time.monotonic() - started


def test_the_cpu_engine_looks_in_the_torch_index_that_answers(tmp_path: Path) -> None:
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"not a real wheel: only listed")
    with torch_index(wheel, tmp_path / "index") as index:
        args, err, _ = _pip_args("cpu", index)
        assert args == [*SHORT, "--extra-index-url", index] and err == ""
        assert _pip_args("gpu", index)[0] == SHORT
        assert _pip_args("cpu", "none")[0] == SHORT


def test_an_index_that_does_not_answer_is_left_out_in_seconds() -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        index = f"http://127.0.0.1:{silent.getsockname()[1]}/simple"
        args, err, took_s = _pip_args("cpu", index)
    assert args == SHORT
    assert f"({index}) did not answer" in err
    assert took_s < 15, "one probe of 10 s at most, not pip's retries for every package"
