"""The floors of docs/ARCHITECTURE.md, checked on every import of every project module
(function-level ones included): no module imports a higher floor or a sibling service."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("telemetry", "infermesh", "gateway", "router_svc", "worker_svc", "devtools")

# (module prefix, unit, floor), most specific prefix first. Units on one floor never import
# each other: the three services, and telemetry and the generated gRPC code.
UNITS: tuple[tuple[str, str, int], ...] = (
    ("infermesh.__main__", "devtools", 3),
    ("devtools", "devtools", 3),
    ("infermesh.pb", "infermesh.pb", 0),
    ("telemetry", "telemetry", 0),
    ("infermesh", "infermesh", 1),
    ("gateway", "gateway", 2),
    ("router_svc", "router_svc", 2),
    ("worker_svc", "worker_svc", 2),
)


def unit_of(module: str) -> tuple[str, int] | None:
    for prefix, unit, floor in UNITS:
        if module == prefix or module.startswith(prefix + "."):
            return unit, floor
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imported_modules(
    module: str, is_package: bool, source: str, known: set[str]
) -> list[tuple[int, str]]:
    """(line, module) of every import in ``source``; ``from a import b`` names ``a.b`` when
    that is a module, so ``from infermesh import cli`` counts as infermesh.config."""
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


def violations(module: str, is_package: bool, source: str, known: set[str]) -> list[str]:
    own = unit_of(module)
    assert own is not None, module
    found = []
    for line, target in imported_modules(module, is_package, source, known):
        other = unit_of(target)
        if other is None or other[0] == own[0]:
            continue
        if other[1] > own[1]:
            found.append(f"{module}:{line} imports {target}, a higher floor ({other[0]})")
        elif other[1] == own[1]:
            found.append(f"{module}:{line} imports {target}, a sibling on its floor")
    return found


def import_graph() -> dict[str, list[str]]:
    modules = project_modules()
    known = set(modules)
    graph: dict[str, list[str]] = {}
    problems: list[str] = []
    for module, path in sorted(modules.items()):
        source = path.read_text()
        is_package = path.name == "__init__.py"
        graph[module] = [t for _, t in imported_modules(module, is_package, source, known)]
        problems += violations(module, is_package, source, known)
    assert not problems, "imports pointing up a floor or across:\n" + "\n".join(problems)
    return graph


def test_no_module_imports_a_higher_floor_or_a_sibling_service() -> None:
    graph = import_graph()
    # the check ran on the real tree: the services, the shared floor and the CLI are all there
    assert {
        "gateway.app",
        "router_svc.server",
        "worker_svc.server",
        "infermesh.config",
        "telemetry.metrics",
        "devtools.main",
    } <= set(graph)
    assert "infermesh.config" in graph["router_svc.config"]
    assert "devtools.mesh" in graph["devtools.main"]
    assert "telemetry" in graph["infermesh.grpc_server"]


def test_the_check_names_an_import_up_a_floor_or_across() -> None:
    known = set(project_modules())
    assert violations(
        "worker_svc.torch_engine.engine", False, "def f():\n    import gateway.app\n", known
    ) == ["worker_svc.torch_engine.engine:2 imports gateway.app, a sibling on its floor"]
    assert violations("telemetry.metrics", False, "from infermesh import config\n", known) == [
        "telemetry.metrics:1 imports infermesh.config, a higher floor (infermesh)"
    ]
    assert violations("gateway.keys", False, "from devtools import plan\n", known) == [
        "gateway.keys:1 imports devtools.plan, a higher floor (devtools)"
    ]
    assert (
        violations("devtools.mesh", False, "from . import plan\nimport worker_svc\n", known) == []
    )
