"""The package's import graph runs one way: each subpackage imports only from layers below it.

A new subpackage or root module must be placed in ``LAYER`` (the test fails until it is), and an import that runs
sideways or upward fails here, naming the module and the import.
"""

import ast
from pathlib import Path

import comera_fx

PACKAGE = Path(comera_fx.__file__).parent

# Lower numbers are lower layers; a module may import from strictly lower layers and from its own subpackage.
LAYER = {
    "tt": 0,
    "rmm": 1,
    "config": 1,
    "quantize": 1,
    "checks": 0,
    "compile_policy": 5,
    "packed": 2,
    "runtime": 1,
    "serving": 1,
    "moe": 2,
    "report": 2,
    "integrations": 2,
    "passes": 3,
    "backend": 4,
    "checkpoint": 4,
    "pretrained": 4,
    "testing": 4,
    "__init__": 5,
}


def top_level(parts: list[str]) -> str:
    """The subpackage (or root module) a dotted path inside comera_fx belongs to."""
    return parts[1] if len(parts) > 1 else "__init__"


def internal_imports(path: Path) -> list[tuple[str, int]]:
    """(the comera_fx part an import names, its line) for every relative or absolute comera_fx import of a file."""
    module = ["comera_fx", *path.relative_to(PACKAGE).with_suffix("").parts]
    package = module[:-1]  # what a one-dot relative import starts from (for __init__.py: its own package)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            target = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            found.append((top_level(target), node.lineno))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "comera_fx":
            found.append((top_level(node.module.split(".")), node.lineno))
        elif isinstance(node, ast.Import):
            found += [
                (top_level(a.name.split(".")), node.lineno) for a in node.names if a.name.split(".")[0] == "comera_fx"
            ]
    return found


def test_every_subpackage_has_a_layer():
    present = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.is_file() and p.suffix == ".py") or (p / "__init__.py").exists()
    }
    assert present == set(LAYER), (
        f"place these in LAYER: {sorted(present - set(LAYER))}; gone: {sorted(set(LAYER) - present)}"
    )


def test_imports_run_downward_only():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = top_level(["comera_fx", *path.relative_to(PACKAGE).with_suffix("").parts])
        for there, line in internal_imports(path):
            if there != here and LAYER[there] >= LAYER[here]:
                wrong.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} imports comera_fx.{there} "
                    f"(layer {LAYER[there]}) from layer {LAYER[here]}"
                )
    assert not wrong, "\n".join(wrong)


def module_imports(path: Path) -> set[str]:
    """The comera_fx modules a file imports (dotted, without the ``comera_fx.`` prefix), at module level or inside a
    function (a call-time import dodges a cycle at import time but is still one)."""
    module = ["comera_fx", *path.relative_to(PACKAGE).with_suffix("").parts]
    package = module[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif (node.module or "").split(".")[0] == "comera_fx":
                base = node.module.split(".")
            else:
                continue
            found.add(".".join(base[1:]))
            found |= {".".join([*base[1:], a.name]) for a in node.names}  # ``from . import x``: x may be a module
        elif isinstance(node, ast.Import):
            found |= {".".join(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "comera_fx"}
    return found


def test_no_import_cycle_between_modules():
    """No chain of imports (module level or call time) leads from a module back to itself; packages'
    ``__init__`` files, which gather their modules' names, are left out."""
    files = {
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts): p
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {name: {m for m in module_imports(path) if m in files and m != name} for name, path in files.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                cycles.append(
                    " -> ".join(trail[trail.index(nxt) :] + [name, nxt]) if nxt in trail else f"{name} -> {nxt}"
                )
            elif nxt not in state:
                visit(nxt, [*trail, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles (move the shared piece to a lower module):\n" + "\n".join(sorted(cycles))
