"""experiments/data/smollm2_prompts.npz (experiments/make_smollm2_data.py): its schema, its sizes, and that
no evaluation prompt (HumanEval, MT-Bench) leaked into the training or calibration prompts."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "experiments" / "data" / "smollm2_prompts.npz"
spec = importlib.util.spec_from_file_location("make_smollm2_data", REPO / "experiments" / "make_smollm2_data.py")
builder = importlib.util.module_from_spec(spec)
spec.loader.exec_module(builder)
SMOLLM2_VOCAB = 49152


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
    assert bool((np.diff(data["offsets"]) > 0).all())
    assert int(data["tokens"].max()) < SMOLLM2_VOCAB
    assert list(data["split_names"]) == list(builder.SPLITS) and list(data["source_names"]) == list(builder.SOURCES)
    assert (len(sets["humaneval"]), len(sets["mtbench"]), len(sets["calibration"])) == (164, 80, 200)
    assert len(sets["train"]) > 8000
    train_sources = data["source"][data["split"] <= 1]
    assert {int(s) for s in np.unique(train_sources)} == {0, 1}  # ShareGPT and stdlib code prompts
    meta = json.loads(str(data["meta"]))
    assert meta["window"] == builder.WINDOW and len(meta["gguf_sha256"]) == 64
    assert DATA.stat().st_size < 4 * 2**20  # travels with the tree
    # Every prompt is the chat template: the same system prefix, ending in the assistant turn.
    everything = [p for s in sets.values() for p in s]
    prefix = everything[0][:10]
    suffix = everything[0][-3:]
    assert all(np.array_equal(p[:10], prefix) and np.array_equal(p[-3:], suffix) for p in everything)


def test_no_evaluation_prompt_is_in_training(sets):
    train = sets["train"] + sets["calibration"]
    evaluation = [sets["humaneval"], sets["mtbench"]]
    seen = {p.tobytes() for p in train}
    assert not any(p.tobytes() in seen for s in evaluation for p in s)
    assert not any(builder.contaminated(train, evaluation))
    # The check can fail: a training prompt carrying a stretch of a HumanEval problem is caught.
    own = builder.own_text(sets["humaneval"])[7]
    planted = np.concatenate([train[0][:20], own[5 : 5 + builder.WINDOW], train[0][20:]])
    assert builder.contaminated([train[1], planted], evaluation) == [False, True]


def test_committed_self_distillation_answers_the_training_prompts(sets):
    """experiments/data/smollm2_selfdistil_10732.npz (the H200 self-distillation kept so a later round can
    skip it; experiments/notes/smollm2.md): sequence i is training prompt prompt_index[i] followed by
    at most 384 generated tokens that end at the first EOS, if any."""
    eos = 2  # <|im_end|>
    with np.load(REPO / "experiments" / "data" / "smollm2_selfdistil_10732.npz") as d:
        tokens, offsets, index, prompt_lengths = d["tokens"], d["offsets"], d["prompt_index"], d["prompt_lengths"]
    assert tokens.dtype == np.uint16 and sorted(index.tolist()) == list(range(len(index)))
    for i, prompt_number in enumerate(index):
        sequence, prompt = tokens[offsets[i] : offsets[i + 1]], sets["train"][prompt_number]
        assert prompt_lengths[i] == len(prompt) and np.array_equal(sequence[: len(prompt)], prompt), i
        response = sequence[len(prompt):]
        assert 1 <= len(response) <= 384, i
        assert eos not in response[:-1].tolist(), i
