"""Screenshots of the router's status page in headless Chromium (Debian's `chromium` package).

python -m benchmarks.screenshot http://127.0.0.1:8000/dashboard -o dashboard.png
python -m benchmarks.screenshot --status-json status.json -o dashboard.png   (a saved /status)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from dpserve.router.control.dashboard import REFRESH_MS, dashboard_html

# Chromium on a closed network: no background connections, no updates, a fresh profile per run.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def run_chromium(profile: Path, *args: str, timeout_s: float = 60) -> str:
    browser = find_chromium()
    if browser is None:
        raise RuntimeError("no chromium on PATH (Debian: apt-get install chromium)")
    command = [browser, *FLAGS, f"--user-data-dir={profile}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"chromium failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def rendered_dom(url: str, profile: Path, wait_ms: int = 5000) -> str:
    """The page's DOM after its scripts ran for `wait_ms` of (virtual) time."""
    return run_chromium(profile, f"--virtual-time-budget={wait_ms}", "--dump-dom", url)


def screenshot(url: str, out: Path, profile: Path, size: tuple[int, int] = (1400, 900), wait_ms: int = 3000) -> Path:
    width, height = size
    run_chromium(
        profile, f"--virtual-time-budget={wait_ms}", f"--window-size={width},{height}", f"--screenshot={out}", url
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.screenshot", description=__doc__)
    parser.add_argument("url", nargs="?", help="the dashboard's URL")
    parser.add_argument("--status-json", type=Path, help="render this saved /status answer instead of a URL")
    parser.add_argument("-o", "--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--size", default="1400x900", help="window WIDTHxHEIGHT (default 1400x900)")
    args = parser.parse_args(argv)
    if (args.url is None) == (args.status_json is None):
        parser.error("give either a URL or --status-json")
    width, height = (int(part) for part in args.size.split("x"))
    with tempfile.TemporaryDirectory(prefix="dpserve-shot-") as work:
        if args.status_json is not None:
            page = Path(work) / "dashboard.html"
            page.write_text(dashboard_html(json.loads(args.status_json.read_text())))
            # Shot before the page's first refresh, which has no router to ask.
            screenshot(page.as_uri(), args.out, Path(work) / "profile", (width, height), REFRESH_MS // 2)
        else:
            screenshot(args.url, args.out, Path(work) / "profile", (width, height))
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
