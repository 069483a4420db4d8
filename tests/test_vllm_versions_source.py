"""dspark against a vLLM release without importing it (0.33 and later pull a CUDA torch):

* the release table (dspark/vllm/versions.py) against the release's source: SpeculativeConfig's
  fields and the method / rejection / draft-sample Literals, read with `ast` from
  vllm/config/speculative.py;
* dspark's dependencies against the release's exact pins (its wheel METADATA): every `==` pin of
  vLLM on a package dspark also requires (nvidia-cutlass-dsl above all) must be inside dspark's
  range, or `pip install "dspark[gpu,vllm]"` cannot resolve.

scripts/test points DSPARK_VLLM_SOURCE at the newest supported release's wheel, unpacked
(vllm/_version.py, vllm/config/speculative.py, vllm-*.dist-info/METADATA). Without it, the installed
vllm is used when there is one."""
from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path

import pytest

from dspark.vllm.versions import FIELDS, VALUES, parse_version


def _source_root() -> Path | None:
    if os.environ.get("DSPARK_VLLM_SOURCE"):
        return Path(os.environ["DSPARK_VLLM_SOURCE"])
    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent.parent if spec is not None and spec.origin else None


ROOT = _source_root()
pytestmark = pytest.mark.skipif(ROOT is None or not (ROOT / "vllm/config/speculative.py").is_file(),
                                reason="no vLLM source: set DSPARK_VLLM_SOURCE to an unpacked vLLM wheel")


def _literal_values(tree: ast.Module) -> dict[str, set[str]]:
    """Module-level `Name = Literal[...]` definitions, nested Literal names expanded."""
    raw: dict[str, list] = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Subscript) and getattr(node.value.value, "id", None) == "Literal"):
            items = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
            raw[node.targets[0].id] = items

    def expand(name: str) -> set[str]:
        out = set()
        for item in raw[name]:
            if isinstance(item, ast.Constant):
                out.add(item.value)
            elif isinstance(item, ast.Name) and item.id in raw:
                out |= expand(item.id)
        return out

    return {name: expand(name) for name in raw}


def _init_fields(tree: ast.Module) -> set[str]:
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig"]
    fields = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            # field(init=False) is set by vLLM itself, not a config key
            if isinstance(node.value, ast.Call) and any(k.arg == "init" for k in node.value.keywords):
                continue
            fields.add(node.target.id)
    return fields


def test_release_table_matches_the_release_source():
    version_text = (ROOT / "vllm/_version.py").read_text()
    found = re.search(r"^__version__ = version = ['\"]([^'\"]+)", version_text, re.MULTILINE)
    assert found, version_text
    installed = parse_version(found.group(1))
    tree = ast.parse((ROOT / "vllm/config/speculative.py").read_text())
    fields = _init_fields(tree)
    literals = _literal_values(tree)

    def present(span):
        return span.since <= installed and (span.until is None or installed <= span.until)

    for name, span in FIELDS.items():
        assert (name in fields) == present(span), (name, span, installed)
    by_field = {"method": literals["SpeculativeMethod"], "rejection_sample_method": literals["RejectionSampleMethod"],
                "draft_sample_method": literals["DraftSampleMethod"]}
    for (name, value), span in VALUES.items():
        assert (value in by_field[name]) == present(span), (name, value, span, installed)


def _vllm_requirements() -> list[str]:
    found = sorted(ROOT.glob("vllm-*.dist-info/METADATA"))
    if found:
        return email.parser.Parser().parsestr(found[-1].read_text()).get_all("Requires-Dist") or []
    return importlib.metadata.distribution("vllm").requires or []


def _dspark_requirements() -> list[str]:
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    return re.findall(r'"([A-Za-z][^"]*)"', text[text.index("dependencies = ["):text.index("[project.scripts]")])


def test_dspark_gpu_extra_admits_vllms_pins():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    ours = {}
    for text in _dspark_requirements():
        req = Requirement(text)
        if req.name != "vllm":
            ours[canonicalize_name(req.name)] = req
    pins = [Requirement(text) for text in _vllm_requirements()]
    pins = [req for req in pins if req.marker is None and canonicalize_name(req.name) in ours
            and any(spec.operator == "==" for spec in req.specifier)]
    assert any(canonicalize_name(req.name) == "nvidia-cutlass-dsl" for req in pins), "vLLM no longer pins cutlass-dsl?"
    for req in pins:
        (pinned,) = [spec.version for spec in req.specifier if spec.operator == "=="]
        mine = ours[canonicalize_name(req.name)]
        assert pinned in mine.specifier, f"vLLM pins {req}, dspark requires {mine}: dspark[gpu,vllm] cannot resolve"
