"""The floors of the package (docs/architecture.md §2), bottom to top:

    kernels   dspark.kernels: torch, cutlass, triton and itself
    core      config, sampling, protocols, policy, metrics and the small helpers every floor uses
    models    dspark.targets and dspark.drafters (the models behind the two protocols)
    engine    the decoding loop: engine, requests, loop, drafting, step, graph_step, build
    tools     what runs the engine or reads the models: sweep, roofline, vllm/, drafter training
              and calibration
    commands  the command line: cli, commands/, vllm/cli (and vllm/__init__, which re-exports it)

A module imports only from its own floor and those below. Checked on the source (AST), so
nothing is imported and every module counts, GPU-only ones included; imports inside a function
count too, those under `if __name__ == "__main__":` (a module run as a command) do not. Every
module must have a floor: a new one is placed here when it is added."""
import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"dspark": ROOT / "dspark", "dspark.kernels": ROOT / "kernels", "dspark.drafters": ROOT / "drafters"}
FLOORS = ("kernels", "core", "models", "engine", "tools", "commands")

# The floor of a module is that of its longest listed prefix ("dspark.vllm" covers dspark.vllm.*).
FLOOR_OF = {
    "dspark.kernels": "kernels",
    **{f"dspark.{name}": "core" for name in (
        "config", "sampling", "protocols", "policy", "metrics", "files", "transfer", "threads", "cuda_graphs",
        "checkpoint_files", "presets", "provenance", "checks", "progress", "flex_tiles")},
    "dspark": "core",  # the package's __init__
    "dspark.targets": "models",
    "dspark.drafters": "models",
    **{f"dspark.{name}": "engine" for name in ("engine", "requests", "loop", "drafting", "step", "graph_step", "build")},
    "dspark.sweep": "tools",
    "dspark.roofline": "tools",
    "dspark.rank_projection": "tools",
    "dspark.vllm": "tools",
    "dspark.drafters.dspark.train": "tools",
    "dspark.drafters.dspark.calibrate": "tools",
    "dspark.cli": "commands",
    "dspark.commands": "commands",
    "dspark.vllm.cli": "commands",
}
# Modules whose floor is not their folder's; the key is the module exactly (a package's __init__).
EXACT_FLOOR = {"dspark.vllm": "commands"}


def source_modules() -> dict[str, str]:
    """{module name: source} of every module of the package, named as installed."""
    modules = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path.read_text()
    return modules


def floor_of(module: str) -> str | None:
    if module in EXACT_FLOOR:
        return EXACT_FLOOR[module]
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        floor = FLOOR_OF.get(".".join(parts[:n]))
        if floor is not None:
            return floor
    return None


def _is_main_guard(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__"
                                                   for c in test.comparators))


@functools.lru_cache(maxsize=None)
def _raw_imports(source: str) -> tuple[tuple[int, int, str | None, tuple[str | None, ...]], ...]:
    """(line, level, module, names) of every import statement of `source` (names: None for
    `import a.b`), outside `if __name__ == "__main__":` blocks. Cached: every test reads the
    same sources."""
    found, stack = [], [ast.parse(source)]
    while stack:
        node = stack.pop()
        if _is_main_guard(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, 0, alias.name, (None,)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.level, node.module, tuple(alias.name for alias in node.names)))
        stack.extend(ast.iter_child_nodes(node))
    return tuple(found)


def imported_modules(module: str, source: str, known: set[str], is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every dspark module `source` imports: `from a import b` names a.b when
    that is a module, else a; a name below a module (dspark.kernels.ops.linear) is that module."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for line, level, name, names in _raw_imports(source):
        if level:
            if level > len(package):
                raise ValueError(f"{module}:{line}: relative import above the top-level package")
            base = ".".join(package[: len(package) - level + 1] + ([name] if name else []))
        else:
            base = name
        if base != "dspark" and not base.startswith("dspark."):
            continue
        for alias in names:
            target = f"{base}.{alias}" if alias is not None and f"{base}.{alias}" in known else base
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if (line, target) not in found:  # `from a import x, y`: one import of a
                found.append((line, target))
    return found


def upward_imports(modules: dict[str, str], packages: set[str] = frozenset()) -> list[str]:
    """`module:line imports target (floor -> higher floor)` for every import of a higher floor."""
    known = set(modules)
    offenders = []
    for module, source in modules.items():
        mine = FLOORS.index(floor_of(module))
        for line, target in imported_modules(module, source, known, module in packages):
            theirs = floor_of(target)
            if theirs is not None and FLOORS.index(theirs) > mine:
                offenders.append(f"{module}:{line} imports {target} ({floor_of(module)} -> {theirs})")
    return offenders


def _packages() -> set[str]:
    return {".".join((package, *p.relative_to(folder).parent.parts))
            for package, folder in FOLDERS.items() for p in folder.rglob("__init__.py")}


def test_every_module_has_a_floor():
    modules = source_modules()
    assert len(modules) > 100, f"found only {len(modules)} modules under {ROOT}"
    unplaced = sorted(m for m in modules if floor_of(m) is None)
    assert not unplaced, f"modules with no floor (add them to FLOOR_OF): {unplaced}"
    assert {floor_of(m) for m in modules} == set(FLOORS)


def test_no_module_imports_a_floor_above_its_own():
    offenders = upward_imports(source_modules(), _packages())
    assert not offenders, "upward imports:\n" + "\n".join(offenders)


@pytest.mark.parametrize("module, planted", [
    ("dspark.step", "from dspark.sweep import grid"),  # engine -> tools
    ("dspark.protocols", "from .engine import Engine"),  # core -> engine
    ("dspark.drafters.uniform", "from dspark.step import full_draft_counts"),  # models -> engine
    ("dspark.targets.toy", "def f():\n    from dspark import loop"),  # a lazy import counts
    ("dspark.kernels.ops", "from .. import sampling"),  # kernels -> core
    ("dspark.roofline", "import dspark.commands.generate"),  # tools -> commands
])
def test_a_planted_upward_import_in_a_copy_of_the_package_is_found(module, planted):
    """The real sources with one upward import added: exactly that one is reported."""
    modules = source_modules()
    line = modules[module].count("\n") + 2 + planted.count("\n")  # after a blank line; a lazy one is indented
    modules[module] += "\n" + planted + "\n"
    offenders = upward_imports(modules, _packages())
    assert len(offenders) == 1 and offenders[0].startswith(f"{module}:{line} imports"), offenders


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
    ("if __name__ == '__main__':\n    from dspark.cli import main", False),  # an entry point
])
def test_the_check_tells_upward_imports_from_imports_inside_the_floor(source, upward):
    """A probe module in kernels/moe/ beside the real ones."""
    modules = source_modules()
    modules["dspark.kernels.moe.probe"] = source
    assert any(o.startswith("dspark.kernels.moe.probe:") for o in upward_imports(modules, _packages())) == upward
