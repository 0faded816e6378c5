"""The floors of docs/ARCHITECTURE.md, read from the folders: a module's floor is that of the
most specific folder holding it. Every import of every module counts (inside its own package,
inside a function, under TYPE_CHECKING): a module imports only its own folder and the floors
below, never a sibling folder on its floor, and no module imports back into one that imports
it, directly or through others. Inside the gateway and the worker their rooms (subpackages)
stand on floors of their own, held to the same rule among themselves."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Floor:
    name: str
    folders: tuple[str, ...]  # its units: folders on one floor never import each other


# Bottom first.
FLOORS = (
    Floor("generated gRPC code and telemetry", ("infermesh/pb", "telemetry")),
    Floor("shared ground floor", ("infermesh",)),
    Floor("services", ("gateway", "router_svc", "worker_svc")),
    Floor("developer tools", ("devtools",)),
    Floor("test helpers", ("tests/helpers",)),
    Floor("benchmarks", ("bench",)),
    Floor("tests", ("tests",)),
)
# The one module that reaches up: `python -m infermesh` is the developer tools' command.
REACHES_UP = {"infermesh/__main__.py": "devtools"}

# The gateway's rooms, bottom first: its configuration under everything, the HTTP plumbing, the
# mesh's client side, then the accounts (whose admin API lists the fleet), the generation the
# APIs share, the API rooms and the console, and on top the gateway's own modules that put the
# app together (gateway/app.py, gateway/routes.py, gateway/__main__.py).
GATEWAY_ROOMS = (
    Floor("the gateway's configuration", ("gateway/config.py",)),
    Floor("HTTP plumbing", ("gateway/http",)),
    Floor("the mesh's client side", ("gateway/mesh",)),
    Floor("accounts", ("gateway/accounts",)),
    Floor("what the APIs share", ("gateway/api", "gateway/batches")),
    Floor("the APIs and the console", ("gateway/openai", "gateway/anthropic", "gateway/console")),
    Floor("the gateway's assembly", ("gateway",)),
)

# The worker's rooms, bottom first: the engine contract every other room speaks (with the cache
# events the engines feed), the hardware it runs on, the model and the decoding beside it, the
# worker's configuration, the engines, the factory that builds the engine the configuration names,
# the gRPC service over it, and on top the process entry (worker_svc/__main__.py).
WORKER_ROOMS = (
    Floor("the engine contract", ("worker_svc/engine",)),
    Floor("the hardware", ("worker_svc/hardware",)),
    Floor("the model and its decoding", ("worker_svc/model", "worker_svc/decoding")),
    Floor("the worker's configuration", ("worker_svc/config.py",)),
    Floor(
        "the engines",
        ("worker_svc/torch_engine", "worker_svc/sim_engine", "worker_svc/vllm_engine"),
    ),
    Floor("the engine factory", ("worker_svc/engine/factory.py",)),
    Floor("the gRPC service", ("worker_svc/service",)),
    Floor("the worker's entry", ("worker_svc",)),
)

# Each service whose rooms are held to their order, by its package.
SERVICE_ROOMS = {"gateway": GATEWAY_ROOMS, "worker_svc": WORKER_ROOMS}


@dataclass(frozen=True)
class Place:
    unit: str  # the folder
    floor: int


def _dotted(folder: str) -> str:
    return folder.removesuffix(".py").replace("/", ".")


def place_of(module: str) -> Place | None:
    """The folder and floor of a module, by its dotted name."""
    for path, folder in REACHES_UP.items():
        if module == _dotted(path):
            return _place_of_folder(folder)
    return _most_specific(module, FLOORS)


def rooms_of(module: str) -> tuple[Floor, ...]:
    """The rooms of the service that holds ``module``; none for a module of no such service."""
    return SERVICE_ROOMS.get(module.split(".")[0], ())


def room_of(module: str) -> Place | None:
    """The room (and the room's floor) of a module of a service with rooms; None for any other."""
    return _most_specific(module, rooms_of(module))


def _most_specific(module: str, floors: tuple[Floor, ...]) -> Place | None:
    best: Place | None = None
    for level, floor in enumerate(floors):
        for folder in floor.folders:
            prefix = _dotted(folder)
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(_dotted(best.unit))
            ):
                best = Place(folder, level)
    return best


def _place_of_folder(folder: str) -> Place:
    place = place_of(_dotted(folder))
    assert place is not None and place.unit == folder, folder
    return place


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files() -> Iterator[Path]:
    """Every Python file of the repository (not the venv, caches or anything hidden)."""
    for path in ROOT.rglob("*.py"):
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            yield path


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for p in python_files()}


def imported_modules(
    module: str, is_package: bool, source: str, known: set[str]
) -> list[tuple[int, str]]:
    """(line, module) of every import in ``source``, wherever it stands; ``from a import b``
    names ``a.b`` when that is a module, else ``a``; relative imports are resolved."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if candidate in known else base))
    return found


def floor_violations(module: str, imports: list[tuple[int, str]]) -> list[str]:
    """Imports of ``module`` that point up a floor or at a sibling folder on its floor."""
    own = place_of(module)
    if own is None:
        return [f"{module} lies in no floor's folder; add its folder to FLOORS"]
    return _violations_from(module, own, imports, place_of, FLOORS)


def room_violations(module: str, imports: list[tuple[int, str]]) -> list[str]:
    """Imports of the service module ``module`` that point up a room's floor or at a sibling
    room on its floor (imports of other packages are the floors' business)."""
    own = room_of(module)
    assert own is not None, module
    service = module.split(".")[0]
    inside = [(line, target) for line, target in imports if target.split(".")[0] == service]
    return _violations_from(module, own, inside, room_of, rooms_of(module))


def _violations_from(
    module: str,
    own: Place,
    imports: list[tuple[int, str]],
    place: Callable[[str], Place | None],
    floors: tuple[Floor, ...],
) -> list[str]:
    found = []
    for line, target in imports:
        other = place(target)
        if other is None or other.unit == own.unit:
            continue
        if other.floor > own.floor:
            found.append(
                f"{module}:{line} imports {target}, a higher floor ({floors[other.floor].name})"
            )
        elif other.floor == own.floor:
            found.append(f"{module}:{line} imports {target}, a sibling on its floor ({other.unit})")
    return found


def cycles(graph: Mapping[str, list[str]]) -> list[list[str]]:
    """Each group of modules that import each other (directly or through others), as one cycle
    through the group: [a, b, ..., a]. Tarjan's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, []):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(group) > 1 or module in graph.get(module, []):
                found.append(_cycle_through(sorted(group), graph))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _cycle_through(group: list[str], graph: Mapping[str, list[str]]) -> list[str]:
    """A path from the group's first module back to it, inside the group (breadth first)."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in graph.get(module, []):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target in members and target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {group}")


def import_graph() -> dict[str, list[tuple[int, str]]]:
    """Each project module's imports of project modules (and of modules no file provides yet,
    such as the generated code before `make proto`)."""
    modules = project_modules()
    known = set(modules)
    return {
        module: imported_modules(module, path.name == "__init__.py", path.read_text(), known)
        for module, path in sorted(modules.items())
    }


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[int, str]]]:
    return import_graph()


def test_every_python_file_lies_on_a_floor(graph):
    assert [module for module in graph if place_of(module) is None] == []
    # the tree was read: each floor's folders hold modules
    for floor in FLOORS:
        for folder in floor.folders:
            assert any(place_of(m) == _place_of_folder(folder) for m in graph), folder


@pytest.mark.parametrize("floor", FLOORS, ids=[floor.name for floor in FLOORS])
def test_the_floor_imports_only_its_own_folder_and_the_floors_below(graph, floor):
    level = FLOORS.index(floor)
    on_floor = [m for m in graph if (place := place_of(m)) is not None and place.floor == level]
    assert on_floor, f"no module on the floor of {floor.name}"
    problems = [v for module in on_floor for v in floor_violations(module, graph[module])]
    assert not problems, f"{floor.name}: imports up a floor or across:\n" + "\n".join(problems)


def _modules_of(service: str, graph: Mapping[str, object]) -> list[str]:
    return [m for m in graph if m == service or m.startswith(service + ".")]


@pytest.mark.parametrize("service", sorted(SERVICE_ROOMS))
def test_every_service_module_lies_in_a_room_and_each_room_holds_modules(graph, service):
    modules = _modules_of(service, graph)
    rooms = SERVICE_ROOMS[service]
    assert modules and all(room_of(m) is not None for m in modules)
    for floor in rooms:
        for room in floor.folders:
            assert any(room_of(m) == _most_specific(_dotted(room), rooms) for m in modules), room


@pytest.mark.parametrize("service", sorted(SERVICE_ROOMS))
def test_the_service_rooms_import_only_their_own_and_the_rooms_below(graph, service):
    problems = [
        v for module in _modules_of(service, graph) for v in room_violations(module, graph[module])
    ]
    assert not problems, f"{service}'s rooms: imports up a floor or across:\n" + "\n".join(problems)


def test_no_module_imports_back_into_a_module_that_imports_it(graph):
    edges = {m: [t for _, t in imports if t in graph and t != m] for m, imports in graph.items()}
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)
    # the check ran on the real tree, imports inside a package included
    assert "worker_svc.service.wire" in edges["worker_svc.service.serve_server"]
    assert "gateway.http.ops" in edges["gateway.routes"]
    assert "devtools.mesh" in edges["devtools.main"]


def test_the_floors_are_named_in_docs_architecture():
    architecture = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for floor in FLOORS + GATEWAY_ROOMS + WORKER_ROOMS:
        assert floor.name in architecture
        for folder in floor.folders:
            written = folder if folder.endswith(".py") else f"{folder}/"
            assert f"`{written}`" in architecture, folder


# Made-up violations: each check fails on one.

_KNOWN = {"gateway.app", "devtools.plan", "infermesh.config", "tests.helpers.fuzz"}


def _violations(module: str, source: str) -> list[str]:
    return floor_violations(module, imported_modules(module, False, source, _KNOWN))


def test_an_import_up_a_floor_is_named_with_the_floor():
    assert _violations("telemetry.metrics", "from infermesh import config\n") == [
        "telemetry.metrics:1 imports infermesh.config, a higher floor (shared ground floor)"
    ]
    assert _violations("gateway.accounts.keys", "from devtools import plan\n") == [
        "gateway.accounts.keys:1 imports devtools.plan, a higher floor (developer tools)"
    ]
    # only infermesh/__main__.py of the ground floor reaches up
    assert _violations("infermesh.__main__", "from devtools import plan\n") == []
    assert _violations("infermesh.config", "from devtools import plan\n") == [
        "infermesh.config:1 imports devtools.plan, a higher floor (developer tools)"
    ]


def test_product_code_importing_tests_or_bench_is_refused():
    assert _violations("worker_svc.service.server", "import bench.mesh_load\n") == [
        "worker_svc.service.server:1 imports bench.mesh_load, a higher floor (benchmarks)"
    ]
    assert _violations("devtools.mesh", "from tests.helpers import fuzz\n") == [
        "devtools.mesh:1 imports tests.helpers.fuzz, a higher floor (test helpers)"
    ]
    # the helpers the benches use sit below them; the tests, above both, may import a bench
    assert _violations("tests.helpers.fuzz", "import bench.soak\n") == [
        "tests.helpers.fuzz:1 imports bench.soak, a higher floor (benchmarks)"
    ]
    assert _violations("bench.fuzz", "from tests.helpers import fuzz\n") == []
    assert _violations("tests.e2e.test_soak", "import bench.soak\n") == []


def test_a_sibling_import_is_named_wherever_it_stands():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import gateway.app\n"
    assert _violations("worker_svc.service.server", source) == [
        "worker_svc.service.server:3 imports gateway.app, a sibling on its floor (gateway)"
    ]
    assert _violations("worker_svc.torch_engine.engine", "def f():\n    import gateway.app\n") == [
        "worker_svc.torch_engine.engine:2 imports gateway.app, a sibling on its floor (gateway)"
    ]


def _room_violations(module: str, source: str) -> list[str]:
    known = {
        "gateway.openai.chat",
        "gateway.anthropic.messages",
        "gateway.api.generation",
        "gateway.http.errors",
    }
    return room_violations(module, imported_modules(module, False, source, known))


def test_a_gateway_room_importing_up_or_across_is_named():
    assert _room_violations("gateway.http.sse", "from gateway.openai import chat\n") == [
        "gateway.http.sse:1 imports gateway.openai.chat, a higher floor (the APIs and the console)"
    ]
    assert _room_violations("gateway.accounts.limits", "import gateway.api.generation\n") == [
        "gateway.accounts.limits:1 imports gateway.api.generation, a higher floor "
        "(what the APIs share)"
    ]
    assert _room_violations("gateway.openai.chat", "from gateway.anthropic import messages\n") == [
        "gateway.openai.chat:1 imports gateway.anthropic.messages, a sibling on its floor "
        "(gateway/anthropic)"
    ]
    # the configuration stands under every room, the app on top of them all
    assert (
        _room_violations("gateway.mesh.client", "from gateway.config import RouterSection\n") == []
    )
    assert _room_violations("gateway.config", "from gateway.http import errors\n") == [
        "gateway.config:1 imports gateway.http.errors, a higher floor (HTTP plumbing)"
    ]
    assert _room_violations("gateway.app", "from gateway.openai import chat\n") == []


def test_a_module_outside_every_floor_is_named():
    assert _violations("scripts.tool", "import os\n") == [
        "scripts.tool lies in no floor's folder; add its folder to FLOORS"
    ]


def test_relative_and_package_imports_are_resolved():
    known = {"router_svc.server", "router_svc.route_stream", "router_svc"}
    assert imported_modules(
        "router_svc.route_stream", False, "from . import server\nfrom .server import x\n", known
    ) == [(1, "router_svc.server"), (2, "router_svc.server")]
    assert imported_modules("router_svc", True, "from .route_stream import y\n", known) == [
        (1, "router_svc.route_stream")
    ]


def test_a_cycle_is_found_through_any_number_of_modules():
    assert cycles({"a": ["b"], "b": ["a"]}) == [["a", "b", "a"]]
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert cycles({"a": ["a"]}) == [["a", "a"]]
    assert cycles({"a": ["b", "c"], "b": ["c"], "c": []}) == []
    # a function-level import that dodges a cycle at run time is still an edge
    source = "def handler():\n    from gateway.app import health\n"
    imports = imported_modules("gateway.http.openapi", False, source, _KNOWN)
    edges = {
        "gateway.http.openapi": [t for _, t in imports],
        "gateway.app": ["gateway.http.openapi"],
    }
    assert cycles(edges) == [["gateway.app", "gateway.http.openapi", "gateway.app"]]


def test_a_worker_room_importing_up_or_across_is_named():
    known = {"worker_svc.service.server", "worker_svc.sim_engine.engine", "worker_svc.engine.api"}

    def violations(module: str, source: str) -> list[str]:
        return room_violations(module, imported_modules(module, False, source, known))

    assert violations("worker_svc.engine.api", "from worker_svc.service import server\n") == [
        "worker_svc.engine.api:1 imports worker_svc.service.server, a higher floor "
        "(the gRPC service)"
    ]
    assert violations(
        "worker_svc.torch_engine.engine", "import worker_svc.sim_engine.engine\n"
    ) == [
        "worker_svc.torch_engine.engine:1 imports worker_svc.sim_engine.engine, a sibling on its "
        "floor (worker_svc/sim_engine)"
    ]
    # the factory stands above the engines it builds, though its file is in the contract's folder
    assert violations("worker_svc.engine.factory", "import worker_svc.sim_engine.engine\n") == []
    assert violations("worker_svc.engine.api", "import worker_svc.sim_engine.engine\n") == [
        "worker_svc.engine.api:1 imports worker_svc.sim_engine.engine, a higher floor (the engines)"
    ]
