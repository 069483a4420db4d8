"""kernels/ is the ground floor: no module under kernels/ (installed as dspark.kernels) imports
the rest of dspark. Checked on the source (AST), so nothing is imported and every module counts,
GPU-only ones included."""
import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
PACKAGE = "dspark.kernels"


def imported_names(source: str, location: Path) -> list[tuple[int, str]]:
    """(line, absolute module or module.name) of every import in `source`, a module at `location`
    relative to kernels/ (which resolves its relative imports)."""
    package = [*PACKAGE.split("."), *location.parent.parts]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(package):
                    raise ValueError(f"{location}:{node.lineno}: relative import above the top-level package")
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            # `from dspark import x` imports the module dspark.x: judge that, not dspark itself
            found += [(node.lineno, f"{base}.{alias.name}" if base == "dspark" else base) for alias in node.names]
    return found


def upward_imports(source: str, location: Path) -> list[str]:
    """`location:line name` for every import of dspark.* that is not dspark.kernels(.*)."""
    return [
        f"kernels/{location}:{line} {name}"
        for line, name in imported_names(source, location)
        if (name == "dspark" or name.startswith("dspark.")) and not (name == PACKAGE or name.startswith(PACKAGE + "."))
    ]


def test_kernels_import_nothing_above_them():
    modules = sorted(KERNELS.rglob("*.py"))
    assert len(modules) > 10, f"found only {len(modules)} modules under {KERNELS}"
    offenders = [hit for m in modules for hit in upward_imports(m.read_text(), m.relative_to(KERNELS))]
    assert not offenders, "kernels/ imports the rest of dspark:\n" + "\n".join(offenders)


@pytest.mark.parametrize("source, upward", [
    ("import dspark.sampling", True),
    ("import dspark", True),
    ("from dspark.targets.kimi_k3 import mxfp4", True),
    ("from dspark import sampling", True),
    ("from ... import sampling", True),  # from kernels/moe/: dspark.sampling
    ("from ...targets import toy", True),
    ("def f():\n    from dspark.config import SamplingParams", True),  # lazy imports count too
    ("from dspark.kernels import ops", False),
    ("from dspark import kernels", False),
    ("import dspark.kernels.registry", False),
    ("from .. import ops", False),
    ("from ..numerics import situ", False),
    ("from . import reference", False),
    ("import torch", False),
])
def test_the_check_tells_upward_imports_from_imports_inside_the_floor(source, upward):
    assert bool(upward_imports(source, Path("moe/probe.py"))) == upward
