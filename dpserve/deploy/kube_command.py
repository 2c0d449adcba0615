"""`dpserve kube`: write the Kubernetes manifests (one multi-document YAML) for N GPU replicas."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from dpserve.deploy.kube import KubeOptions, render


def kube_options(replicas: int, **given: Any) -> KubeOptions:
    """Flags left out (None) keep KubeOptions' defaults; a ValueError names the bad flag."""
    names = {f.name for f in dataclasses.fields(KubeOptions)}
    unknown = set(given) - names
    if unknown:
        raise TypeError(f"not options of dpserve kube: {', '.join(sorted(unknown))}")
    return KubeOptions(replicas=replicas, **{name: value for name, value in given.items() if value is not None})


def run_kube(replicas: int, output: Path | None, **given: Any) -> int:
    try:
        options = kube_options(replicas, **given)
    except ValueError as exc:
        print(f"dpserve kube: {exc}", file=sys.stderr)
        return 2
    text = render(options)
    if output is None:
        sys.stdout.write(text)
        return 0
    output.write_text(text)
    print(
        f"dpserve kube: wrote {output} ({options.replicas} replica(s) of {options.model}, "
        f"{options.tensor_parallel_size} GPU(s) each, namespace "
        f"{options.namespace}); create the Secret {options.keys_secret} first, then kubectl apply -f {output}",
        file=sys.stderr,
    )
    return 0
