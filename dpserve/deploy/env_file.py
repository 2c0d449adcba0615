"""The `.env` file Docker Compose reads, read by python-dotenv's parser: quotes, `export`, escapes and inline
`# comments` as Compose reads them. A line it cannot parse is an error, as in Compose; a name with no `=` sets
nothing."""

from __future__ import annotations

from pathlib import Path

from dotenv.parser import parse_stream


def read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    with path.open(encoding="utf-8") as stream:
        for binding in parse_stream(stream):
            if binding.error:
                line = binding.original.string.strip()
                raise ValueError(f"{path}:{binding.original.line}: not KEY=VALUE: {line!r}")
            if binding.key is not None and binding.value is not None:
                values[binding.key] = binding.value
    return values
