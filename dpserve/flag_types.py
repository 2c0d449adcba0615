"""Argparse types for the flags that are not settings (`dpserve bench NAME`, `dpserve tune`): a number within
bounds, a comma list of counts, a file or folder that must exist. A bad value stops at parse time with
argparse's own error, which names the flag (`argument --sims: '-1' must be at least 1`), never later as a
traceback. Each type keeps its bounds as attributes, which the fuzz (tests/unit/test_cli_fuzz.py) reads to
make the values it must refuse."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

LARGEST_INT = 2**63 - 1
"""As dpserve.config's: what C code below Python takes."""
LARGEST_FLOAT = 1e9
"""As dpserve.config's: a billion seconds is past any wait, and below threading's TIMEOUT_MAX."""


class Number:
    """A whole number (`kind` int) or any finite number (float) from `least` (above it where `above`) to `most`."""

    def __init__(self, kind: type[int] | type[float], least: float, *, above: bool = False) -> None:
        self.kind = kind
        self.least = least
        self.above = above
        self.most = LARGEST_INT if kind is int else LARGEST_FLOAT
        self.__name__ = "whole number" if kind is int else "number"  # what argparse calls the type

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {self.__name__}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if self.above and value <= self.least:
            raise argparse.ArgumentTypeError(f"{text!r} must be more than {self.least:g}")
        if value < self.least:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {self.least:g}")
        if value > self.most:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {self.most:g}")
        return value

    def __repr__(self) -> str:  # argparse shows a type's repr in some errors
        return self.__name__


COUNT = Number(int, 1)
"""How many of something: at least 1."""
WHOLE = Number(int, 0)
"""A seed, or a count where 0 means none or unbounded."""
POSITIVE = Number(float, 0, above=True)
"""A duration or a rate: more than 0."""
NON_NEGATIVE = Number(float, 0)
"""A warm-up, a pause, a weight or a speed where 0 means none."""
SHARE = Number(float, 0)
"""A fraction: from 0 to 1."""
SHARE.most = 1.0


def counts(text: str) -> str:
    """A comma-separated list of counts (`1,256,1024`), each at least 1; the text itself, as its default is."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} names no count (e.g. 1,2,4)")
    for item in items:
        COUNT(item)
    return text


def existing_file(text: str) -> Path:
    """A file that must be there to be read."""
    path = _path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file" if path.exists() else f"no file {text!r}")
    return path


def existing_folder(text: str) -> Path:
    """A folder that must be there."""
    path = _path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {text!r}")
    return path


def _path(text: str) -> Path:
    if not text:
        raise argparse.ArgumentTypeError("'' is no path")  # Path('') is the current folder
    return Path(text)


class Names:
    """A comma-separated list of names, each one of `known` (none at all only where `empty` is allowed); the
    text itself, as its default is."""

    def __init__(self, known: tuple[str, ...], *, empty: bool = False) -> None:
        self.known = known
        self.empty = empty
        self.__name__ = "names"

    def __call__(self, text: str) -> str:
        given = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in given if name not in self.known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}: of {', '.join(self.known)}")
        if not given and not self.empty:
            raise argparse.ArgumentTypeError(f"{text!r} names none: of {', '.join(self.known)}")
        return text

    def __repr__(self) -> str:
        return self.__name__
