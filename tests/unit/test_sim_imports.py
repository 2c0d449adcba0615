"""The simulator's modules import one way, function-level imports included: dpserve.sim.server serves (one
replica or a fleet) and nothing below it imports it back."""

from __future__ import annotations

import ast

from tests.unit.test_layering import PACKAGE, find_cycle, graph

SIM = "dpserve.sim."


def sim_edges() -> dict[str, set[str]]:
    edges = graph(module_level_only=False)
    return {m: {t for t in targets if t.startswith(SIM)} for m, targets in edges.items() if m.startswith(SIM)}


def test_the_sim_modules_import_one_way() -> None:
    edges = sim_edges()
    assert {"dpserve.sim.server", "dpserve.sim.fleet"} <= set(edges)
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle in dpserve/sim: " + " -> ".join(cycle or [])


def test_only_the_server_imports_the_server_and_the_fleet_imports_the_replica() -> None:
    edges = sim_edges()
    assert [m for m, targets in edges.items() if "dpserve.sim.server" in targets] == []
    assert {"dpserve.sim.fleet", "dpserve.sim.replica"} <= edges["dpserve.sim.server"]
    assert "dpserve.sim.replica" in edges["dpserve.sim.fleet"]


def test_one_module_runs_uvicorn() -> None:
    serving = sorted(
        path.stem
        for path in (PACKAGE / "sim").glob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(name.split(".")[0] == "uvicorn" for name in _imported(node))
    )
    assert serving == ["server"]


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""] if node.level == 0 else []
    return [alias.name for alias in node.names]
