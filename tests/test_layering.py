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
