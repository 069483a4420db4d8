"""Docs that cannot drift. Every `docs/<file>.md §N` citation in the repository resolves to a
heading numbered N in that file; every repository path quoted in docs/*.md, README.md,
tools/lab/README.md and the package's comments and docstrings (dspark/, kernels/, drafters/)
exists; docs/kernels.md's table of registered implementations is the registry's; no package
comment or docstring carries a commit hash (git keeps those; docs/kernels.md §11 says where
measured figures live).

Each checker is a function of text, so the parametrised cases below show it catching what it is
for: a test that cannot fail would guard nothing."""
from __future__ import annotations

import ast
import glob
import io
import itertools
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The repository's top-level folders: a quoted path is checked when it starts with one of them
# (`runs/`, `.gpu/` and other projects' paths such as `vllm/v1/...` are not this tree's).
TOP_LEVEL = ("dspark", "kernels", "drafters", "experiments", "tests", "docs", "scripts", "notebooks", "tools")
PACKAGE = ("dspark", "kernels", "drafters")
TEXT_SUFFIXES = (".py", ".md", ".sh", ".ipynb", ".toml", ".txt", ".cfg")


def repository_files() -> list[Path]:
    """The tracked files (git ls-files), or, where the tree travels without .git, every file
    outside hidden folders, caches and build outputs."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        files = [REPO / name for name in listed.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {"__pycache__", "build", "runs", "results"}
        files = [p for p in REPO.rglob("*") if p.is_file()
                 and not any(part.startswith(".") or part in skip or part.endswith(".egg-info")
                             for part in p.relative_to(REPO).parts[:-1])]
    return [p for p in files if p.suffix in TEXT_SUFFIXES and p.is_file()]


# ---- citations: docs/<file>.md §N --------------------------------------------------------------
NUMBER = r"\d+(?:\.\d+)*"
# "docs/kernels.md §4.3", "`docs/kimi-k3.md §1.2-1.3`", "(docs/kernels.md §4, §6)": a range's
# second end may drop its §, a list's items keep theirs (a bare number after a comma is prose).
CITATION = re.compile(rf"(?<![\w./-])docs/([\w./-]+\.md)`?\s*§\s*({NUMBER})((?:\s*[-–]\s*§?\s*{NUMBER}|\s*(?:,|and)\s*§\s*{NUMBER})*)")
HEADING = re.compile(rf"^#{{1,6}}\s+({NUMBER})\.?(?:\s|$)", re.MULTILINE)


def section_numbers(markdown: str) -> set[str]:
    return set(HEADING.findall(markdown))


def cited_sections(text: str) -> list[tuple[str, str]]:
    """(doc file name, section number) for every section a citation names (both ends of a range)."""
    found = []
    for match in CITATION.finditer(text):
        numbers = [match.group(2), *re.findall(NUMBER, match.group(3))]
        found += [(match.group(1), number) for number in numbers]
    return found


def broken_citations(text: str, where: str, sections: dict[str, set[str]]) -> list[str]:
    broken = []
    for name, number in cited_sections(text):
        if name not in sections:
            broken.append(f"{where}: docs/{name} does not exist (cited as §{number})")
        elif number not in sections[name]:
            broken.append(f"{where}: docs/{name} has no section {number}")
    return broken


def doc_sections() -> dict[str, set[str]]:
    return {p.name: section_numbers(p.read_text()) for p in sorted((REPO / "docs").glob("*.md"))}


# ---- quoted repository paths -------------------------------------------------------------------
BACKTICKED = re.compile(r"`([^`\s]+)`")
# A path in a comment or docstring: a top-level folder, a slash, then path characters. Not
# preceded by a path character, so /tmp/dspark_pkg/dspark/... or $REPO/experiments/... are not read.
CODE_PATH = re.compile(rf"(?<![\w./$-])((?:{'|'.join(TOP_LEVEL)})/[\w./*{{}},<>:-]*)")


def normalised(path: str) -> str | None:
    """The path part of a quoted reference (`file.py:NAME`, `test.py::test_x` and trailing
    punctuation dropped), or None when it is not this repository's."""
    path = path.removeprefix("./").split("::")[0].split(":")[0].rstrip(".,;)")
    if path.split("/")[0] not in TOP_LEVEL or "/" not in path:
        return None
    return path


def expanded(path: str) -> list[str]:
    """`a_{on,off}.json` -> both names; `<device>` placeholders match any one folder or name part."""
    path = re.sub(r"<[^>/]*>", "*", path)
    parts = re.split(r"\{([^{}]*)\}", path)
    if len(parts) == 1:
        return [path]
    choices = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def path_exists(path: str, root: Path = REPO) -> bool:
    for candidate in expanded(path):
        if any(ch in candidate for ch in "*?["):
            if not glob.glob(str(root / candidate)):
                return False
        elif not (root / candidate).exists():
            return False
    return True


def missing_paths(quoted: list[tuple[int, str]], where: str, root: Path = REPO) -> list[str]:
    """`where:line: path` for each quoted repository path that does not exist under root."""
    found = []
    for line, raw in quoted:
        path = normalised(raw)
        if path is not None and not path_exists(path, root):
            found.append(f"{where}:{line}: {path}")
    return found


def markdown_paths(markdown: str) -> list[tuple[int, str]]:
    return [(markdown.count("\n", 0, m.start()) + 1, m.group(1)) for m in BACKTICKED.finditer(markdown)]


def comment_texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every docstring (module, class, function) in `source`."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.append((first.lineno, first.value.value))
    return found


def code_paths(source: str) -> list[tuple[int, str]]:
    return sorted((line + text.count("\n", 0, m.start()), m.group(1))
                  for line, text in comment_texts(source) for m in CODE_PATH.finditer(text))


def package_modules() -> list[Path]:
    return [p for p in repository_files() if p.suffix == ".py" and p.relative_to(REPO).parts[0] in PACKAGE]


# ---- commit hashes in package comments ---------------------------------------------------------
HEX_RUN = re.compile(r"(?<![0-9A-Za-z])[0-9a-f]{7,40}(?![0-9A-Za-z])")


def commit_hashes(text: str) -> list[re.Match]:
    """Runs of 7-40 lowercase hex digits, standing alone (an underscore or a dot bounds them, so
    `step_bench_77f9fb8.json` counts), with at least one letter and one digit."""
    return [m for m in HEX_RUN.finditer(text) if re.search("[a-f]", m.group()) and re.search("[0-9]", m.group())]


def hashes_in_comments(source: str, where: str) -> list[str]:
    return sorted(f"{where}:{line + text.count(chr(10), 0, m.start())}: {m.group()}"
                  for line, text in comment_texts(source) for m in commit_hashes(text))


# ---- docs/kernels.md's table of registered implementations --------------------------------------
IMPLEMENTATIONS_HEADER = "| Op | Implementations, highest priority first (where each runs) |"
IMPL_ENTRY = re.compile(r"`(\w+)` \(([^()]*)\)")


def implementations_table(markdown: str) -> dict[str, list[tuple[str, str]]]:
    """op -> [(implementation, where it runs), ...] in the table's order."""
    lines = markdown.splitlines()
    if IMPLEMENTATIONS_HEADER not in lines:
        raise ValueError(f"docs/kernels.md: no table headed {IMPLEMENTATIONS_HEADER!r}")
    table = {}
    for line in itertools.takewhile(lambda s: s.startswith("|"), lines[lines.index(IMPLEMENTATIONS_HEADER) + 2:]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 2 or not re.fullmatch(r"`\w+`", cells[0]):
            raise ValueError(f"docs/kernels.md: implementations row {line!r} is not | `op` | `impl` (where), ... |")
        table[cells[0].strip("`")] = IMPL_ENTRY.findall(cells[1])
    return table


def runs_on(impl) -> str:
    """Where an Implementation runs, as the table writes it: "CPU, CUDA", "CUDA", "CUDA 9.0",
    "CUDA 10.0-10.3"."""
    devices = ", ".join(d.upper() for d in impl.devices)
    low, high = impl.min_capability, impl.max_capability
    if low is None and high is None:
        return devices
    low_text = f"{low[0]}.{low[1]}" if low else ""
    high_text = f"{high[0]}.{high[1]}" if high else ""
    return f"{devices} {low_text if low_text == high_text else f'{low_text}-{high_text}'}"


def table_drift(table: dict[str, list[tuple[str, str]]], registry: dict[str, dict]) -> list[str]:
    drift = [f"op {op!r} is registered but not in the table" for op in sorted(set(registry) - set(table))]
    drift += [f"op {op!r} is in the table but not registered" for op in sorted(set(table) - set(registry))]
    for op in sorted(set(table) & set(registry)):
        listed, impls = dict(table[op]), registry[op]
        if set(listed) != set(impls):
            drift.append(f"{op}: the table lists {sorted(listed)}, the registry has {sorted(impls)}")
            continue
        drift += [f"{op}.{name}: the table says it runs on {listed[name]!r}, the registry {runs_on(impls[name])!r}"
                  for name in listed if listed[name] != runs_on(impls[name])]
        priorities = [impls[name].priority for name, _ in table[op]]
        if priorities != sorted(priorities, reverse=True):
            drift.append(f"{op}: listed in the order {[n for n, _ in table[op]]}, priorities {priorities}")
    return drift


# ---- the repository ----------------------------------------------------------------------------
def test_every_docs_citation_names_a_numbered_section():
    sections = doc_sections()
    assert {"kernels.md", "kimi-k3.md", "dspark-algorithm.md"} <= set(sections)
    # This file's own cases cite missing sections on purpose.
    files = [p for p in repository_files() if p != Path(__file__).resolve()]
    assert len(files) > 100, f"found only {len(files)} text files under {REPO}"
    cited = [c for p in files for c in cited_sections(p.read_text(errors="replace"))]
    assert len(cited) > 50, f"found only {len(cited)} citations: is the pattern still the repo's style?"
    broken = [b for p in files for b in broken_citations(p.read_text(errors="replace"), str(p.relative_to(REPO)), sections)]
    assert not broken, "citations of sections that do not exist:\n" + "\n".join(broken)


def test_every_path_quoted_in_the_docs_exists():
    documents = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "tools/lab/README.md"]
    missing = [m for d in documents for m in missing_paths(markdown_paths(d.read_text()), str(d.relative_to(REPO)))]
    assert not missing, "paths quoted in the docs that do not exist:\n" + "\n".join(missing)


def test_every_path_in_package_comments_exists():
    modules = package_modules()
    assert len(modules) > 50, f"found only {len(modules)} package modules"
    missing = [m for p in modules for m in missing_paths(code_paths(p.read_text()), str(p.relative_to(REPO)))]
    assert not missing, "paths in package comments and docstrings that do not exist:\n" + "\n".join(missing)


def test_no_package_comment_carries_a_commit_hash():
    found = [h for p in package_modules() for h in hashes_in_comments(p.read_text(), str(p.relative_to(REPO)))]
    assert not found, ("commit hashes in package comments (cite the result file or the notes, "
                       "experiments/notes/, which keep the history):\n" + "\n".join(found))


def test_the_kernels_doc_lists_exactly_the_registered_implementations():
    from dspark.kernels import registry

    registry.implementations("linear")  # loads every op package
    # The package's ops only: a test may register a probe op of its own (test_engine_kernel_scopes).
    registered = {op: impls for op, impls in registry._IMPLS.items()
                  if any(impl.fn.__module__.startswith("dspark.kernels") for impl in impls.values())}
    assert len(registered) >= 10
    table = implementations_table((REPO / "docs/kernels.md").read_text())
    drift = table_drift(table, registered)
    assert not drift, "docs/kernels.md §10's implementations table differs from the registry:\n" + "\n".join(drift)


# ---- the checkers catch what they are for ------------------------------------------------------
SECTIONS = {"kernels.md": {"4", "4.3", "6", "10.1", "10.2"}, "kimi-k3.md": {"1.2", "1.3"}}


@pytest.mark.parametrize("text, broken", [
    ("see docs/kernels.md §4.3", []),
    ("see docs/kernels.md §4.4", ["docs/kernels.md has no section 4.4"]),
    ("(`docs/kimi-k3.md §1.2-1.3`)", []),
    ("(`docs/kimi-k3.md §1.2-1.4`)", ["docs/kimi-k3.md has no section 1.4"]),
    ("(docs/kernels.md §4, §6)", []),
    ("(docs/kernels.md §4, §7)", ["docs/kernels.md has no section 7"]),
    ("docs/kernels.md §4, 16 layers", []),  # a bare number after a comma is prose
    ("docs/kernels.md§10.1 and §10.3", ["docs/kernels.md has no section 10.3"]),
    ("docs/nothing.md §1", ["docs/nothing.md does not exist"]),
    ("(docs/docs/kernels.md §4)", ["docs/docs/kernels.md does not exist"]),
    ("/work/main/docs/kernels.md §9", []),  # another checkout's path, not a citation
])
def test_a_citation_of_a_missing_section_is_caught(text, broken):
    assert [b.split(": ", 1)[1].split(" (")[0] for b in broken_citations(text, "x", SECTIONS)] == broken


def test_section_numbers_come_from_numbered_headings_only():
    markdown = "# Title 3\n## 0. Shapes\n### 1.4 Testing\n## 10. Contracts\n### 10.10 `situ_glu`\nsee §5\n## Notes 6\n"
    assert section_numbers(markdown) == {"0", "1.4", "10", "10.10"}


def test_a_quoted_path_that_does_not_exist_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/kernels.md").write_text("x")
    (tmp_path / "experiments/results/h200").mkdir(parents=True)
    (tmp_path / "experiments/results/h200/a_on.json").write_text("{}")
    markdown = ("`docs/kernels.md` `docs/kernels.md:§4` `docs/gone.md` `runs/sweep.png` `vllm/v1/x.py` "
                "`experiments/results/<device>/*.json` `experiments/results/h200/a_{on,off}.json` `a b/c`")
    missing = missing_paths(markdown_paths(markdown), "README.md", tmp_path)
    assert missing == ["README.md:1: docs/gone.md", "README.md:1: experiments/results/h200/a_{on,off}.json"]


def test_paths_are_read_from_comments_and_docstrings_only(tmp_path):
    source = ('"""Module: see kernels/moe/gone.py."""\n'
              'import os\n'
              'X = "kernels/not_a_comment.py"\n'
              'def f():\n'
              '    """Docstring.\n\n    Cites experiments/results/h200/gone.json, and\n    /tmp/dspark_pkg/dspark/x.py."""\n'
              '    return os.sep  # tests/gpu/test_x.py::test_y.\n')
    assert code_paths(source) == [(1, "kernels/moe/gone.py."), (7, "experiments/results/h200/gone.json,"),
                                  (9, "tests/gpu/test_x.py::test_y.")]
    assert missing_paths(code_paths(source), "m.py", tmp_path) == [
        "m.py:1: kernels/moe/gone.py", "m.py:7: experiments/results/h200/gone.json", "m.py:9: tests/gpu/test_x.py"]


@pytest.mark.parametrize("text, hashes", [
    ("measured at a7cdf4d on the H200", ["a7cdf4d"]),
    ("(experiments/results/h200/step_bench_77f9fb8.json)", ["77f9fb8"]),
    ("commit 0123456789abcdef0123456789abcdef01234567", ["0123456789abcdef0123456789abcdef01234567"]),
    ("a deadbeef value, 1234567 rows, 0x7f800000, fp8e4m3fn, sm_90a, 2e5b37", []),
    ("AbCdEf12345", []),  # capitals: not git's spelling of a hash
])
def test_a_commit_hash_in_a_comment_is_caught(text, hashes):
    assert [m.group() for m in commit_hashes(text)] == hashes
    assert len(hashes_in_comments(f"x = 1  # {text}\n", "m.py")) == len(hashes)


class FakeImpl:
    def __init__(self, priority, devices=("cuda",), low=None, high=None):
        self.priority, self.devices, self.min_capability, self.max_capability = priority, devices, low, high


REGISTRY = {"linear": {"reference": FakeImpl(0, ("cpu", "cuda")), "cute_sm90": FakeImpl(10, low=(9, 0), high=(9, 0)),
                       "cute_sm100": FakeImpl(10, low=(10, 0), high=(10, 3))},
            "rms_norm": {"reference": FakeImpl(0, ("cpu", "cuda")), "triton": FakeImpl(10)}}
TABLE = f"""{IMPLEMENTATIONS_HEADER}
|---|---|
| `linear` | `cute_sm90` (CUDA 9.0), `cute_sm100` (CUDA 10.0-10.3), `reference` (CPU, CUDA) |
| `rms_norm` | `triton` (CUDA), `reference` (CPU, CUDA) |

after the table
"""


@pytest.mark.parametrize("edit, drift", [
    (lambda t: t, []),
    (lambda t: t.replace(", `cute_sm100` (CUDA 10.0-10.3)", ""), ["linear: the table lists"]),
    (lambda t: t.replace("(CUDA 9.0)", "(CUDA 9.0-10.3)"), ["linear.cute_sm90: the table says"]),
    (lambda t: t.replace("`triton` (CUDA), `reference` (CPU, CUDA)", "`reference` (CPU, CUDA), `triton` (CUDA)"),
     ["rms_norm: listed in the order"]),
    (lambda t: t.replace("| `rms_norm` | `triton` (CUDA), `reference` (CPU, CUDA) |\n", ""),
     ["op 'rms_norm' is registered but not in the table"]),
    (lambda t: t.replace("\n\nafter", "\n| `latent_moe` | `cute_sm90` (CUDA 9.0) |\n\nafter"),
     ["op 'latent_moe' is in the table but not registered"]),
])
def test_the_implementations_table_check_catches_drift(edit, drift):
    found = table_drift(implementations_table(edit(TABLE)), REGISTRY)
    assert [f[:len(d)] for f, d in zip(found, drift)] == drift and len(found) == len(drift), found


def test_an_unreadable_implementations_row_is_an_error():
    with pytest.raises(ValueError, match="is not"):
        implementations_table(TABLE.replace("| `linear` |", "| linear |"))
    with pytest.raises(ValueError, match="no table headed"):
        implementations_table("| Op | Here |\n|---|---|\n")
