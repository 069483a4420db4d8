"""experiments/data/smollm2_prompts.npz (experiments/make_smollm2_data.py): its schema, its sizes, that it
extends the issue-13 prompts in place (the committed self-distillation still answers its first training
prompts), that the held-out prompts are their own, and that no evaluation prompt (HumanEval, MT-Bench)
leaked into the training, calibration or held-out prompts. Also the builder's pieces on made-up input:
how a later turn takes its conversation in, how a long docstring is cut, which signatures are kept."""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "experiments" / "data" / "smollm2_prompts.npz"
spec = importlib.util.spec_from_file_location("make_smollm2_data", REPO / "experiments" / "make_smollm2_data.py")
builder = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = builder  # dataclasses look their module up there
spec.loader.exec_module(builder)
SMOLLM2_VOCAB = 49152
IM_START, IM_END, USER = 1, 2, 4093  # <|im_start|>, <|im_end|>, "user" in the SmolLM2 vocabulary
ISSUE13_TRAIN = 10_732  # training prompts of issue 13's self-distillation (smollm2_selfdistil_10732.npz, in git)


@pytest.fixture(scope="module")
def data():
    with np.load(DATA) as d:
        return {k: d[k] for k in d.files}


@pytest.fixture(scope="module")
def sets():
    return builder.load_prompts(DATA)


def test_schema_and_sizes(data, sets):
    assert set(data) == {"tokens", "offsets", "split", "source", "split_names", "source_names", "meta"}
    assert data["tokens"].dtype == np.uint16 and data["offsets"].dtype == np.int64
    assert data["split"].dtype == np.uint8 and data["source"].dtype == np.uint8
    n = len(data["split"])
    assert len(data["offsets"]) == n + 1 and data["offsets"][0] == 0 and data["offsets"][-1] == len(data["tokens"])
    lengths = np.diff(data["offsets"])
    assert bool((lengths > 0).all()) and int(lengths.max()) <= builder.MAX_PROMPT_TOKENS
    assert int(data["tokens"].max()) < SMOLLM2_VOCAB
    assert list(data["split_names"]) == list(builder.SPLITS) and list(data["source_names"]) == list(builder.SOURCES)
    assert (len(sets["humaneval"]), len(sets["mtbench"]), len(sets["calibration"])) == (164, 80, 200)
    assert len(sets["heldout"]) == builder.HELDOUT_PROMPTS and len(sets["train"]) > 40_000
    sources = [str(s) for s in data["source_names"]]
    train = np.bincount(data["source"][data["split"] == 0], minlength=len(sources))
    assert train[sources.index("sharegpt_later_turn")] > 30_000 and train[sources.index("stdlib")] > 2_000
    assert all(train[sources.index(library)] > 500 for library in builder.LIBRARIES)
    meta = json.loads(str(data["meta"]))
    assert meta["window"] == builder.WINDOW and len(meta["gguf_sha256"]) == 64
    assert meta["base"]["rows_kept"] == ISSUE13_TRAIN + 200
    assert DATA.stat().st_size < 8 * 2**20  # travels with the tree beside half of the GGUF
    # Every prompt is the chat template: the same system prefix, ending in the assistant turn.
    everything = [p for s in sets.values() for p in s]
    prefix = everything[0][:10]
    suffix = everything[0][-3:]
    assert all(np.array_equal(p[:10], prefix) and np.array_equal(p[-3:], suffix) for p in everything)


def user_turns(prompt: np.ndarray) -> int:
    return int(((prompt[:-1] == IM_START) & (prompt[1:] == USER)).sum())


def last_turn(prompt: np.ndarray) -> bytes:
    """The tokens of the prompt's last user message (its <|im_start|>user line to its <|im_end|>)."""
    starts = np.flatnonzero((prompt[:-1] == IM_START) & (prompt[1:] == USER))
    end = starts[-1] + np.flatnonzero(prompt[starts[-1]:] == IM_END)[0]
    return prompt[starts[-1] : end].tobytes()


def test_conversations_fit_the_context_budget_and_prompts_are_distinct(sets):
    prompts = sets["train"] + sets["calibration"] + sets["heldout"]
    assert len({p.tobytes() for p in prompts}) == len(prompts)
    turns = np.array([user_turns(p) for p in prompts])
    lengths = np.array([len(p) for p in prompts])
    assert (turns >= 1).all() and (turns > 1).sum() > 10_000, "later turns carry their conversation"
    assert int(lengths[turns > 1].max()) <= builder.CONTEXT_PROMPT_TOKENS


def test_heldout_prompts_share_no_last_turn_with_training(sets):
    trained = {last_turn(p) for p in sets["train"] + sets["calibration"]}
    assert not any(last_turn(p) in trained for p in sets["heldout"])


def test_issue13_training_prompts_come_first(sets):
    """The first 10,732 training prompts are the ones issue 13's self-distillation answered, all single
    turns; the prompts after them are issue 33's."""
    assert all(user_turns(p) == 1 for p in sets["train"][:ISSUE13_TRAIN])
    assert any(user_turns(p) > 1 for p in sets["train"][ISSUE13_TRAIN : ISSUE13_TRAIN + 100])


def test_no_evaluation_prompt_is_in_training(sets):
    train = sets["train"] + sets["calibration"] + sets["heldout"]
    evaluation = [sets["humaneval"], sets["mtbench"]]
    seen = {p.tobytes() for p in train}
    assert not any(p.tobytes() in seen for s in evaluation for p in s)
    assert not any(builder.contaminated(train, evaluation))
    # The check can fail: a training prompt carrying a stretch of a HumanEval problem is caught.
    own = builder.own_text(sets["humaneval"])[7]
    planted = np.concatenate([train[0][:20], own[5 : 5 + builder.WINDOW], train[0][20:]])
    assert builder.contaminated([train[1], planted], evaluation) == [False, True]


def test_committed_self_distillation_answers_the_training_prompts(sets):
    """experiments/data/smollm2_selfdistil_58278.npz (experiments/smollm2_generate.py on the H100;
    experiments/notes/smollm2.md): sequence i is training prompt i followed by 1 to 384 generated
    tokens that end at the first EOS when ended_at_eos[i]; half greedy, half at T 0.7 / top-p 0.8."""
    eos = 2  # <|im_end|>
    with np.load(REPO / "experiments" / "data" / "smollm2_selfdistil_58278.npz") as d:
        tokens, offsets, index, prompt_lengths = d["tokens"], d["offsets"], d["prompt_index"], d["prompt_lengths"]
        temperature, top_p, ended = d["temperature"], d["top_p"], d["ended_at_eos"]
    assert tokens.dtype == np.uint16 and index.tolist() == list(range(len(sets["train"])))
    for i, prompt in enumerate(sets["train"]):
        sequence = tokens[offsets[i] : offsets[i + 1]]
        assert prompt_lengths[i] == len(prompt) and np.array_equal(sequence[: len(prompt)], prompt), i
        response = sequence[len(prompt):]
        assert 1 <= len(response) <= 384, i
        assert eos not in response[:-1].tolist() and (response[-1] == eos) == ended[i], i
    assert (temperature == 0).sum() == len(temperature) // 2
    assert set(temperature[temperature > 0].tolist()) == {np.float32(0.7)}
    assert set(top_p[temperature > 0].tolist()) == {np.float32(0.8)}


# ---- the builder's pieces ------------------------------------------------------------------------
def toy_chat(messages) -> np.ndarray:
    """A stand-in tokenizer: one token per word, the template's tokens as builder.TEMPLATE_TOKENS and
    MESSAGE_TOKENS say."""
    words = sum(len(m["content"].split()) for m in messages)
    return np.arange(builder.TEMPLATE_TOKENS + builder.MESSAGE_TOKENS * (len(messages) - 1) + words, dtype=np.uint16)


def words(n: int) -> str:
    return " ".join(["w"] * n)


def test_a_later_turn_takes_whole_exchanges_nearest_first(monkeypatch):
    monkeypatch.setattr(builder, "CONTEXT_PROMPT_TOKENS", 100)
    count = lambda text: len(text.split())  # noqa: E731
    conversation = [("user", words(30)), ("assistant", words(20)), ("user", words(10)), ("assistant", words(10)),
                    ("user", words(5))]
    # 30 + 5 for the turn, + 10 + 10 + 10 for the nearer exchange = 65; the first would add 60 more.
    assert len(builder.turn_prompt(count, toy_chat, conversation, 4, {})) == 65
    monkeypatch.setattr(builder, "CONTEXT_PROMPT_TOKENS", 200)
    assert len(builder.turn_prompt(count, toy_chat, conversation, 4, {})) == 125
    broken = [("assistant", words(30))] + conversation[1:]  # the earlier exchange is two assistant turns
    assert len(builder.turn_prompt(count, toy_chat, broken, 4, {})) == 65
    foreign = conversation[:3] + [("assistant", "d\u00e9j\u00e0 vu")] + conversation[4:]  # non-ASCII answer
    assert len(builder.turn_prompt(count, toy_chat, foreign, 4, {})) == 35
    monkeypatch.setattr(builder, "MAX_TURN_TOKENS", 4)
    assert builder.turn_prompt(count, toy_chat, conversation, 4, {}) is None


def test_long_docstrings_lose_their_optional_sections():
    doc = ("Sum things.\n\nParameters\n----------\na : int\n    .. note:: stays, it is inside a parameter\n\n"
           "Returns\n-------\nint\n\nSee Also\n--------\nprod\n\nNotes\n-----\nlong\n\nExamples\n--------\n>>> f(1)\n1")
    assert builder.trimmed_doc(doc) == ("Sum things.\n\nParameters\n----------\na : int\n"
                                        "    .. note:: stays, it is inside a parameter\n\nReturns\n-------\nint")
    torch_style = "Do x.\n\nArgs:\n    x: y\n\n.. note::\n    careful\n\nReturns:\n    r\n\nExample::\n\n    >>> f()\n"
    assert builder.trimmed_doc(torch_style) == "Do x.\n\nArgs:\n    x: y\n\nReturns:\n    r"


def test_signatures_come_from_inspect_or_the_docstring_and_must_parse():
    class Builtin:  # an instance has no inspectable signature; its docstring states one, as torch's builtins do
        __doc__ = "add(input, other, *, alpha=1) -> Tensor\n\nAdds other, scaled by alpha, to input, element by element."

    assert builder._signature_and_doc("add", Builtin()) == (
        "(input, other, *, alpha=1) -> Tensor", "Adds other, scaled by alpha, to input, element by element.")

    def stated(x, y):
        """stated(x, y)

        Returns x and y together as one tuple, in that order, unchanged."""
    assert builder._signature_and_doc("stated", stated) == (
        "(x, y)", "Returns x and y together as one tuple, in that order, unchanged.")

    def short(x):
        """In-place version of add."""
    assert builder._signature_and_doc("short", short) is None

    sentinel = object()

    def addressed(x=sentinel):
        """Has a default whose repr carries a memory address, so no prompt can state it stably."""
    assert builder._signature_and_doc("addressed", addressed) is None

    def pybind(*args, **kwargs):
        """Overloaded function.

        1. pybind(self, opts: Options = <Options object at 0x7f00c0ffee00>) -> None, stated by pybind11."""
    assert builder._signature_and_doc("pybind", pybind) is None


def test_splits_keep_the_base_first_and_hold_out_prompts_of_their_own(monkeypatch):
    """Base rows stay first as they were; new rows follow a conversation at a time; calibration and
    heldout (when the base has none) take only prompts whose key no other candidate shares."""
    monkeypatch.setattr(builder, "CALIBRATION_PROMPTS", 2)
    monkeypatch.setattr(builder, "HELDOUT_PROMPTS", 3)
    rng = np.random.default_rng()
    base = [(rng.integers(0, 100, 5).astype(np.uint16), split, "sharegpt") for split in ("train", "calibration", "train")]
    # Three conversations of three turns; only the last turn of each has a key of its own, so whatever
    # the order, heldout must be exactly those three.
    keys = ["shared", "shared", "a", "shared", "shared", "b", "shared", "shared", "c"]
    candidates = [builder.Candidate(np.array([i], dtype=np.uint16), "sharegpt_later_turn", key, f"c{i // 3}")
                  for i, key in enumerate(keys)]
    rows = builder.assign_splits(base, candidates, seed=int(rng.integers(1 << 30)))
    assert rows[:3] == base
    new = rows[3:]
    assert sorted(int(t[0]) for t, _, _ in new) == list(range(len(keys)))
    groups = [int(t[0]) // 3 for t, _, _ in new]
    assert all(groups[i] == groups[i - 1] or groups[i] not in groups[:i] for i in range(1, len(groups))), groups
    assert sorted(keys[int(t[0])] for t, split, _ in new if split == "heldout") == ["a", "b", "c"]
    assert not any(split == "calibration" for _, split, _ in new)  # the base has its calibration
    with pytest.raises(ValueError, match="too few prompts"):  # calibration would need two more own keys
        builder.assign_splits([], candidates, seed=0)
