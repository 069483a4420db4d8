"""Issue 34's bound on class size: no class in dspark/ or drafters/ over ~300 lines, so each stays
readable alone (kernels/ holds the CuTe kernel classes, which are exempt). Checked on the source (AST)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES = 310  # "~300": a little room for a docstring, none for a second responsibility


def long_classes(source: str, limit: int = MAX_CLASS_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every class, nested ones included, longer than `limit` lines."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit]


def test_no_class_in_the_package_is_over_the_bound():
    found = {f"{path.relative_to(ROOT)}:{name}": lines
             for folder in ("dspark", "drafters") for path in sorted((ROOT / folder).rglob("*.py"))
             for name, lines in long_classes(path.read_text())}
    assert not found, f"classes over {MAX_CLASS_LINES} lines: {found}"


def test_the_check_finds_a_long_class_and_passes_a_short_one():
    body = "".join(f"    x{i} = {i}\n" for i in range(12))
    assert long_classes(f"class Long:\n{body}", limit=10) == [("Long", 13)]
    assert long_classes(f"class Short:\n{body}", limit=13) == []
    assert long_classes(f"def f():\n    class Inner:\n{body.replace('    ', '        ')}", limit=10) == [("Inner", 13)]
