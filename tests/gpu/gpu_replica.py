"""A replica on a real GPU for the `gpu` tests, where vLLM is not installed: a `dpserve sim` whose
child process holds GPU memory and keeps the GPU busy with matrix products, the shape of a vLLM
replica (API server, with the engine core on the GPU as its child). Needs PyTorch with CUDA.

    python gpu_replica.py PORT SECONDS
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def gpu_child(seconds: float, parent: int) -> None:
    import torch

    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, so NVML shows real usage
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and os.getppid() == parent:  # ends with its replica
        for _ in range(50):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    del held


def main() -> None:
    port, seconds = sys.argv[1], float(sys.argv[2])
    if len(sys.argv) > 3:
        gpu_child(seconds, int(sys.argv[3]))
        return
    child = subprocess.Popen([sys.executable, __file__, port, str(seconds), str(os.getpid())], stdout=subprocess.PIPE)
    assert child.stdout is not None
    if child.stdout.readline().strip() != b"ready":
        sys.exit("the GPU child did not start")
    # Same pid from here on: the GPU child stays a child of the replica's server.
    command = [sys.executable, "-m", "dpserve", "sim", "--port", port, "--tokenizer", "fast", "--log-level", "warning"]
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
