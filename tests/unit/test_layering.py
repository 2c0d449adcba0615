"""The package's layering, written down once and checked by reading every module's imports with `ast`:
each layer imports only from layers below it (or within its own package), the router's rooms only the
rooms below them, and no module-level import cycle anywhere in `dpserve/` and `benchmarks/`.

The checkout's benchmarks are a layer too: dpserve/checkout.py loads them by name at run time (an edge `ast`
cannot see), so its BENCH_MODULES are added as its edges, and no other module may reach them.

Run with `-s` to see the graph printed."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpserve.checkout import BENCH_MODULES

CHECKOUT = Path(__file__).resolve().parents[2]
PACKAGE = CHECKOUT / "dpserve"
BENCHMARKS = CHECKOUT / "benchmarks"
TOPS = ("dpserve", "benchmarks")  # the import names the graph follows
# The one module that reaches benchmarks/, and the edges it takes (loaded by name, so invisible to `ast`).
BENCHMARKS_DOOR = "dpserve.checkout"
DOOR_EDGES = {f"benchmarks.{module}" for module in BENCH_MODULES.values()}

LAYERS: tuple[tuple[str, ...], ...] = (
    # Lowest first. A module may import its own package and anything in a lower layer, nothing else.
    # Settings, an ASGI helper, background tasks' end, the tiny-model builder, terminal tables.
    (
        "dpserve.config",
        "dpserve.flag_types",
        "dpserve.disconnect",
        "dpserve.background",
        "dpserve.tiny_model",
        "dpserve.tiny_lora",
        "dpserve.text_table",
        "dpserve.version",
    ),
    ("dpserve.kvindex", "dpserve.gpu"),  # pure data: the KV-block index, NVML samples
    ("dpserve.policies",),  # pure routing decisions
    ("dpserve.replicas",),  # the router's view of replicas: registry, catalog, health, probes, KV-event subscribers
    ("dpserve.sim", "dpserve.agent"),  # the vLLM-compatible simulator; the per-host GPU agent
    ("dpserve.router",),  # the gateway
    ("dpserve.tune",),  # `dpserve tune`: kv_aware's weights replayed in a model of the fleet
    ("dpserve.up",),  # the `dpserve up` supervisor, which starts the router as a child
    ("dpserve.deploy",),  # compose files, Kubernetes manifests, dashboards
    ("benchmarks",),  # the checkout's benchmarks (not installed): any layer of dpserve below, never the commands
    ("dpserve.checkout",),  # `dpserve bench`'s door to benchmarks/ (loads them by name)
    ("dpserve.cli",),  # the commands
    ("dpserve.cli_docs",),  # docs/cli.md, from the commands' parser
    ("dpserve.__main__",),  # python -m dpserve
)

ROUTER_ROOMS: tuple[str, ...] = (
    # The router's rooms, top first: a module imports only its own room and the rooms after it. A request
    # enters at `routing` (the proxied endpoints), which asks `quality` and `flow` and sends with `http`;
    # `app`, `serve` and `shutdown` (the room's own top level) assemble and run it.
    "",  # dpserve/router/*.py: serve, app, parts
    "control",  # the admin API, replica discovery, the status page, engine operations
    "batch",  # /v1/files and /v1/batches, their store, and the runner that sends lines down the request path
    "peers",  # routers sharing what they know
    "fleet",  # GPU agents and the fleet's GPU view
    "routing",  # the request's path: proxied endpoints, features, selection, dispatch
    "scale",  # the desired-replicas signal, and requests waiting for a replica to start
    "quality",  # receipts, shadow policies, prefill cost
    "flow",  # who may send (access, tenants, quotas), in what order (admission, fair queue), usage
    "observe",  # metrics, prompt-token counting
    "http",  # the wire: errors, endpoint table, request bodies, the upstream client, the server protocol
)


def module_name(path: Path) -> str:
    parts = path.relative_to(CHECKOUT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *BENCHMARKS.glob("*.py")])


def is_ours(name: str) -> bool:
    return name.split(".")[0] in TOPS


def imports(path: Path, module_level_only: bool) -> Iterator[str]:
    """The dpserve and benchmarks modules `path` imports (`from x import y` counts as x.y when y is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.If) and module_level_only:
            continue  # `if TYPE_CHECKING:` blocks do not run
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if is_ours(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not is_ours(target):
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                yield candidate if candidate in MODULES else target


MODULES = {module_name(path) for path in sources()}


def graph(module_level_only: bool) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in sources():
        name = module_name(path)
        edges[name] = {target for target in imports(path, module_level_only) if target != name}
    if not module_level_only:
        edges[BENCHMARKS_DOOR] |= DOOR_EDGES  # at run time, when `dpserve bench` runs one
    return edges


def layer_of(module: str) -> int:
    for rank, layer in enumerate(LAYERS):
        for top in layer:
            if module == top or module.startswith(top + "."):
                return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def package_of(module: str) -> str:
    for layer in LAYERS:
        for top in layer:
            if module == top or module.startswith(top + "."):
                return top
    return module


def test_every_module_is_in_a_layer_and_imports_only_downwards() -> None:
    edges = graph(module_level_only=False)
    upward = []
    print("\nimport graph (package level):")
    packages: dict[str, set[str]] = {}
    for module, targets in edges.items():
        if module == "dpserve":
            continue
        for target in targets:
            if target == "dpserve":  # the package itself (its location), not a layer
                continue
            if package_of(target) != package_of(module):
                packages.setdefault(package_of(module), set()).add(package_of(target))
            if layer_of(target) > layer_of(module) or (
                layer_of(target) == layer_of(module) and package_of(target) != package_of(module)
            ):
                upward.append(f"{module} -> {target}")
    for package in sorted(packages, key=layer_of):
        print(f"  {package} (layer {layer_of(package)}) -> {', '.join(sorted(packages[package], key=layer_of))}")
    assert not upward, "imports that run up (or sideways) a layer:\n" + "\n".join(upward)


BENCHMARKS_NAME = re.compile(r"benchmarks(\.\w+)*")


def names_benchmarks(source: str) -> list[str]:
    """Where `source` names a benchmarks module as a value (a call's argument, an assignment, the start of an
    f-string): how a module would load one by name, past what `imports` sees. Keyword arguments (a flag's
    help text) and docstrings are prose."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            values = node.args
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            values = [node.value]
        else:
            continue
        for value in values:
            text = value.values[0] if isinstance(value, ast.JoinedStr) and value.values else value
            if isinstance(text, ast.Constant) and isinstance(text.value, str):
                named = text.value if text is value else text.value.rstrip(".")
                if BENCHMARKS_NAME.fullmatch(named):
                    found.append(ast.unparse(value))
    return found


def test_only_the_door_reaches_the_benchmarks() -> None:
    """dpserve.checkout alone loads benchmarks/ (by import or by name), so the edges the graph adds for it are all
    there are."""
    edges = graph(module_level_only=False)
    reaching = [
        f"{module} -> {target}"
        for module, targets in edges.items()
        if module.startswith("dpserve") and module != BENCHMARKS_DOOR
        for target in targets
        if target.split(".")[0] == "benchmarks"
    ]
    for path in sorted(PACKAGE.rglob("*.py")):
        if module_name(path) != BENCHMARKS_DOOR:
            reaching += [f"{module_name(path)} names {text}" for text in names_benchmarks(path.read_text("utf-8"))]
    assert not reaching, f"only {BENCHMARKS_DOOR} may reach benchmarks/:\n" + "\n".join(reaching)
    assert DOOR_EDGES <= MODULES, f"BENCH_MODULES names modules benchmarks/ lacks: {DOOR_EDGES - MODULES}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('importlib.import_module("benchmarks.fleet")', ["'benchmarks.fleet'"]),
        ('__import__("benchmarks")', ["'benchmarks'"]),
        ('importlib.import_module(f"benchmarks.{name}")', ["f'benchmarks.{name}'"]),
        ('WHERE = "benchmarks.loadgen"', ["'benchmarks.loadgen'"]),
        ('parser.add_parser("bench", help="benchmarks")', []),
        ('print("benchmarks/README.md")', []),
    ],
)
def test_names_benchmarks_finds_loads_by_name(source: str, expected: list[str]) -> None:
    assert names_benchmarks(source) == expected


def room_of(module: str) -> str:
    """`dpserve.router.flow.admission` -> `flow`; the router's top-level modules -> ''."""
    inside = module.removeprefix("dpserve.router.").split(".")
    return inside[0] if len(inside) > 1 else ""


def test_the_router_rooms_import_one_way() -> None:
    edges = graph(module_level_only=False)
    router = [m for m in edges if m.startswith("dpserve.router.")]
    rooms = {room_of(m) for m in router}
    assert rooms == set(ROUTER_ROOMS), (
        f"ROUTER_ROOMS must list every room of dpserve/router: {rooms ^ set(ROUTER_ROOMS)}"
    )
    wrong = []
    print("\nrouter rooms, top first:")
    for rank, room in enumerate(ROUTER_ROOMS):
        members = [m for m in router if room_of(m) == room]
        targets = {room_of(t) for m in members for t in edges[m] if t.startswith("dpserve.router.")} - {room}
        print(f"  {room or '(top)'} -> {', '.join(sorted(targets, key=ROUTER_ROOMS.index)) or '-'}")
        wrong += [
            f"{m} -> {t}"
            for m in members
            for t in edges[m]
            if t.startswith("dpserve.router.") and ROUTER_ROOMS.index(room_of(t)) < rank
        ]
    assert not wrong, "router imports up a room:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle_at_module_level() -> None:
    edges = graph(module_level_only=True)
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a path that returns to its start, or None (depth-first, three colours)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ],
)
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]], expected: list[str] | None) -> None:
    assert find_cycle(edges) == expected


LONGEST_FUNCTION = 100
"""Lines, decorators and docstring included: a function longer than this is more than one job."""


def test_no_function_is_longer_than_a_page() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > LONGEST_FUNCTION:
                    long.append(f"{module_name(path)}.{node.name}: {node.end_lineno - first + 1} lines")
    assert not long, "functions over a page:\n" + "\n".join(long)
