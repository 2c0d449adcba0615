"""A replica-shaped process tree on a real GPU, for the `gpu` tests where vLLM is not installed: a
parent that answers HTTP on a port (as vLLM's API server does) and a child that holds GPU memory and
keeps the GPU busy with matrix products (as vLLM's engine core does). Needs PyTorch with CUDA.

    python gpu_replica.py PORT SECONDS     (prints `ready` once the child holds the GPU)
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import time


def child(seconds: float) -> None:
    import torch

    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, so NVML shows real usage
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(50):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    del held


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"object": "list", "data": []}' if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[3] == "child":
        child(seconds)
        return
    worker = subprocess.Popen([sys.executable, __file__, str(port), str(seconds), "child"], stdout=subprocess.PIPE)
    assert worker.stdout is not None
    if worker.stdout.readline().strip() != b"ready":
        sys.exit("the GPU child did not start")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    print("ready", flush=True)
    try:
        server.serve_forever()
    finally:
        worker.kill()


if __name__ == "__main__":
    main()
