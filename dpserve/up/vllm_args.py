"""The flags given to vLLM after `--`, read as vLLM's own parser reads them: `--max_num_seqs` is
`--max-num-seqs`, any unambiguous prefix (`--max-num-s`) names the flag, and when one is given twice the
last wins. `dpserve up`, `compose` and `kube` read a few of them (the batch limit, the served name) and
add their own only where the user gave none."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence


def flag_name(arg: str) -> str:
    """A vLLM flag's name as vLLM reads it (`--max_model_len=8` is `--max-model-len`); "" for a value."""
    if not arg.startswith("-"):
        return ""
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def listed(name: str, flags: Iterable[str]) -> str | None:
    """The flag of `flags` that `name` is, or abbreviates (vLLM's parser takes any unambiguous prefix)."""
    flags = tuple(flags)
    if name in flags:
        return name
    if name.startswith("--") and len(name) > 3:
        return next((flag for flag in flags if flag.startswith(name)), None)
    return None


def given(args: Sequence[str], *names: str) -> bool:
    """One of the flags `names` is among `args`, in any spelling vLLM accepts."""
    return any(listed(flag_name(arg), names) is not None for arg in args)


def value_of(args: Sequence[str], name: str) -> str | None:
    """The value given to flag `name` (`--flag VALUE` or `--flag=VALUE`; of a list, its first): the last one
    given, as argparse keeps it; None where the flag is not among `args` or has no value."""
    value: str | None = None
    wanted: Collection[str] = (name,)
    for index, arg in enumerate(args):
        if listed(flag_name(arg), wanted) is None:
            continue
        _, equals, inline = arg.partition("=")
        if equals:
            value = inline
        elif index + 1 < len(args) and not args[index + 1].startswith("-"):
            value = args[index + 1]
    return value
