"""Lower layers never import higher ones; heavy or UI libraries stay in their layer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flowrl"

# Lowest first (DESIGN.md section 3). A module may import its own layer or lower ones.
LAYERS = [
    {"errors", "records", "spec", "graph"},
    {"devices"},
    {"backends"},
    {"algorithms"},
    {"data", "rewards"},
    {"roles"},
    {"profiler"},
    {"planner"},
    {"runtime"},
    {"scheduler", "simulator"},
    {"api"},
    {"ui", "cli", "__init__"},
]
ONLY_IN = {"dask": {"runtime"}, "distributed": {"runtime"}, "rich": {"ui", "cli"}, "yaml": {"spec"}, "typer": {"cli"}}


def _layer_of(part: str) -> int:
    for index, layer in enumerate(LAYERS):
        if part in layer:
            return index
    raise AssertionError(f"flowrl.{part} belongs to no layer: add it to LAYERS")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _own_part(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def test_no_module_imports_a_higher_layer() -> None:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _own_part(path)
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "flowrl" and len(parts) > 1:
                if _layer_of(parts[1]) > _layer_of(own):
                    problems.append(f"{path.relative_to(PACKAGE)} imports {name}")
            allowed = ONLY_IN.get(parts[0])
            if allowed is not None and own not in allowed:
                problems.append(f"{path.relative_to(PACKAGE)} imports {parts[0]} (only in {sorted(allowed)})")
    assert problems == []


def test_spec_graph_and_planner_run_without_torch() -> None:
    """The planner works on numbers only: it plans clusters it does not have, on machines
    without torch's import cost (DESIGN.md section 3)."""
    code = (
        "import sys\n"
        "import flowrl.spec.loader, flowrl.graph, flowrl.planner.search, flowrl.planner.placement\n"
        "import flowrl.planner.compiled, flowrl.planner.costs, flowrl.devices.matching\n"
        "print(sorted(name for name in ('torch', 'transformers', 'dask') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
