"""experiments/smollm2_profile.py's choice of batches and its figures over them: a step's cost grows with
its batch's supervised tokens, so the profile spans the epoch's batches instead of timing its first."""
import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("smollm2_profile", REPO / "experiments" / "smollm2_profile.py")
profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile)
recipe = profile.recipe


def sequence_file(path: Path, count: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(12, 200, size=count)
    sequences = [rng.integers(3, 49152, size=n).astype(np.uint16) for n in lengths]
    recipe.save_sequences(path, list(range(count)), sequences, [int(rng.integers(2, n // 2)) for n in lengths])
    return path


def test_the_batches_span_the_epoch_by_supervised_tokens(tmp_path):
    path = sequence_file(tmp_path / "seqs.npz", 96, seed=np.random.SeedSequence().entropy % 2**32)
    ns = recipe.parse(["run", "--batch-size", "4", "--seed", "3"])
    args = argparse.Namespace(sequences=str(path), batches=4, seed=0, batch_size=4, seq_len=64)
    batches = profile.profiled_batches(args, ns, profile.SMOLLM2)
    totals = [sum(data["supervised"]) for _, _, data in batches]
    assert len(batches) == 4 and totals == sorted(totals) and totals[0] < totals[-1]
    # each is one of the recipe's first-epoch batches, with its loss masks
    sequences, masks = recipe.load_training_sequences(path)
    cfg = recipe.train_configs(ns)["dspark"]
    epoch = profile.epoch_batches([int(m.sum()) for m in masks], cfg, 0)
    supervised = [int(m.sum()) for m in masks]
    all_totals = sorted(sum(supervised[i] for i in b) for b in epoch)
    assert totals == [all_totals[int((k + 0.5) * len(epoch) / 4)] for k in range(4)]
    for seqs, ms, data in batches:
        assert [int(m.sum()) for m in ms] == data["supervised"] and [len(s) for s in seqs] == data["lengths"]
        assert data["buckets"] == list(recipe.static_buckets(sequences, masks, ns.num_anchors))


def test_a_piece_over_batches_is_their_mean_with_the_costliest_batch_named():
    rng = np.random.default_rng()
    walls = rng.uniform(5, 50, size=3)

    def measurement(wall, kernels):
        return {"wall_ms": wall, "gpu_ms": wall / 2, "kernels": kernels, "aten_calls": 2 * kernels,
                "top_gpu": [{"name": f"k{kernels}", "calls": 1, "ms": wall}], "top_host": []}

    taken = [measurement(w, k) for w, k in zip(walls, (100, 140, 180))]
    out = profile.over_batches(taken)
    assert out["wall_ms"] == pytest.approx(walls.mean(), abs=0.01) and out["kernels"] == pytest.approx(140)
    assert out["top_gpu"] == taken[int(np.argmax(walls))]["top_gpu"]
    assert [b["wall_ms"] for b in out["per_batch"]] == list(walls)
    assert "warmup_s" not in out


def test_a_pieces_warm_up_is_summed_over_its_batches():
    """The warm-up seconds (a compiled piece's compiles) are the batches' total, each batch's kept."""
    warmups = np.random.default_rng().uniform(0.1, 40, size=3).round(2)
    taken = [{"wall_ms": 1.0, "gpu_ms": 0.5, "kernels": 1, "aten_calls": 2, "top_gpu": [], "top_host": [], "warmup_s": w}
             for w in warmups]
    out = profile.over_batches(taken)
    assert out["warmup_s"] == pytest.approx(warmups.sum(), abs=0.01)
    assert [b["warmup_s"] for b in out["per_batch"]] == list(warmups)


def test_warm_up_times_its_calls():
    calls = []
    seconds = profile.warm_up(lambda: (calls.append(1), time.sleep(0.02)), 3)
    assert len(calls) == 3 and 0.06 <= seconds < 5


def test_batches_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        profile.main(["--batches", "0", "--out", "x.json"])
    assert "--batches=0" in capsys.readouterr().err


def test_the_precision_piece_measures_bf16_operands_beside_the_stores_rounding(tmp_path):
    """--pieces precision on a small random Llama at SmolLM2's vocabulary: the bf16-operand capture's
    tap errors are those of bf16 operands (above the store's rounding alone, below 2e-2), the store's own
    rounding is at most bf16's half-ulp (2^-9 relative, in norm), and the teacher figures are a mean L1
    distance in [0, 2] and a fraction."""
    import dataclasses

    import torch
    from test_dspark_train_fast import TINY, tiny_llama

    config = dataclasses.replace(TINY, vocab_size=49152, num_layers=8, context_length=256)
    target = tiny_llama(int(np.random.SeedSequence().entropy % 2**31), config=config, max_seq_len=256)
    path = sequence_file(tmp_path / "seqs.npz", 24, seed=np.random.SeedSequence().entropy % 2**32)
    args = argparse.Namespace(sequences=str(path), batches=2, seed=0, batch_size=4, seq_len=64)
    out = {}
    with torch.no_grad():
        profile.precision_piece(config, target.weights, args, out, lambda: None)
    result = out["capture_precision"]
    assert result["positions"] == sum(sum(b["lengths"]) for b in result["batches"])
    operands, store = result["bf16_operands"], result["bf16_store"]
    assert set(operands["tap_relative_error"]) == set(store["tap_relative_error"]) and str(config.num_layers) in store["tap_relative_error"]
    for layer, error in store["tap_relative_error"].items():
        assert 0 < error <= 2**-9 and error < operands["tap_relative_error"][layer] < 2e-2, (layer, error, operands)
    for figures in (operands, store):
        assert 0 <= figures["teacher_l1_mean"] <= 2 and 0 <= figures["teacher_argmax_changed"] <= 1
    assert store["teacher_l1_mean"] < operands["teacher_l1_mean"]


def test_the_checks_piece_times_a_held_out_check():
    """--pieces checks on a small random Llama: held_out measured, with its warm-up."""
    import dataclasses

    from test_dspark_train_fast import TINY, tiny_llama

    config = dataclasses.replace(TINY, num_layers=3, context_length=256)
    target = tiny_llama(int(np.random.SeedSequence().entropy % 2**31), config=config, max_seq_len=256)
    args = argparse.Namespace(seed=0, held_out_prompts=3, held_out_tokens=4, seq_len=32)
    out = {}
    profile.checks_piece(config, target.weights, args, out, lambda: None)
    assert out["held_out"]["wall_ms"] > 0 and out["held_out"]["aten_calls"] > 0 and out["held_out"]["warmup_s"] > 0
    assert set(out) == {"held_out"}