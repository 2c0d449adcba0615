"""dpserve: a data-parallel inference gateway for LLMs.

The hot path's modules may be compiled (mypyc; `make compiled`): an extension module beside its `.py`
takes precedence on import. DPSERVE_PURE_PYTHON=1 runs the source instead (`make test PURE=1`), compiled
files or not: set before the first import of a `dpserve` module, and inherited by the processes it starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import (
    BYTECODE_SUFFIXES,
    SOURCE_SUFFIXES,
    FileFinder,
    ModuleSpec,
    SourceFileLoader,
    SourcelessFileLoader,
)
from types import ModuleType


class _SourceFirst:
    """Finds dpserve's modules among `.py` and `.pyc` files only, passing over extension modules."""

    @staticmethod
    def find_spec(name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if path is None or not name.startswith("dpserve."):
            return None
        loaders = ((SourceFileLoader, SOURCE_SUFFIXES), (SourcelessFileLoader, BYTECODE_SUFFIXES))
        for entry in path:
            spec = FileFinder(entry, *loaders).find_spec(name)
            if spec is not None:
                return spec
        return None


if os.environ.get("DPSERVE_PURE_PYTHON") == "1":
    sys.meta_path.insert(0, _SourceFirst())
