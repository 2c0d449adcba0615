"""The docs point at what exists: every relative link in the Markdown a reader opens (README, CHANGELOG, docs/,
benchmarks/README.md) names a file of the checkout, and its #anchor a heading of that file; every results
folder the docs cite as backing a figure (`benchmarks/results/...`, or `results/...` on a benchmark's page)
is there. A page that moves history elsewhere, or a rerun that replaces a folder, must keep these true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").rglob("*.md")]
)
BENCHMARK_PAGES = ROOT / "docs" / "benchmarks"
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_RESULTS = re.compile(r"(?<![\w/.-])((?:benchmarks/)?results/[\w.*/-]+)")
_NOT_PATH_END = ".,;:"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(heading) for heading in _HEADING.findall(_FENCE.sub("", page.read_text()))}


def _prose(page: Path) -> str:
    """The page without its fenced blocks: a shell example's paths are output a reader writes, not ours."""
    return _FENCE.sub("", page.read_text())


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_reaches_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not the checkout's to keep
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {_name(linked)}")
    assert not broken, f"{_name(page)}: " + "; ".join(broken)


def _cited_results(page: Path) -> list[str]:
    cited = []
    for match in _RESULTS.findall(_prose(page)):
        path = match.rstrip(_NOT_PATH_END)
        if not path.startswith("benchmarks/"):
            if page.parent != BENCHMARK_PAGES:
                continue  # `results/...` elsewhere is a command's output folder, not the checkout's
            path = "benchmarks/" + path
        cited.append(path)
    return cited


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_cited_results_folder_exists(page: Path) -> None:
    missing = [path for path in _cited_results(page) if not any(ROOT.glob(path.rstrip("/")))]
    assert not missing, f"{_name(page)} cites results that are not in the checkout: {missing}"


def test_the_reference_backs_its_figures_with_results() -> None:
    """docs/measured.md is the page of current figures: each benchmark's entry names the folder of its run."""
    cited = _cited_results(ROOT / "docs" / "measured.md")
    for benchmark in ("overhead", "cost", "scale", "fairness", "lora", "policies", "vllm-dp", "routers", "scaling"):
        assert any(path.startswith(f"benchmarks/results/{benchmark}/") for path in cited), benchmark
