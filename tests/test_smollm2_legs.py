"""Training in legs (experiments/smollm2_dspark.py): both trained drafters packed in bf16 with their
lineage, split into parts that come back from a device call, and loaded by the next leg's --start-from
(or, finished, by a run that evaluates it: --finished, tests/test_smollm2_recipe.py)."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import smollm2_dspark as recipe  # noqa: E402
import staging  # noqa: E402

from dspark.drafters.dspark import DSparkModel, save_checkpoint  # noqa: E402

VOCAB, HIDDEN = 96, 32


def fake_target():
    """What the recipe's drafter config reads of a target (SmolLM2's 30 layers at a small width)."""
    return SimpleNamespace(num_layers=30, vocab_size=VOCAB, hidden_size=HIDDEN)


def variant(name: str, seed: int) -> DSparkModel:
    torch.manual_seed(seed)
    embed, lm_head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    model = DSparkModel(recipe.drafter_config(fake_target(), name, 2, 8), embed, lm_head)
    with torch.no_grad():  # away from any start, as training leaves them
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    if name == "dflash_ablation":
        recipe.make_dflash_ablation(model)
    return model


def trained_work(work: Path, steps: int, earlier_legs: dict | None = None) -> dict[str, DSparkModel]:
    models = {name: variant(name, i + int(torch.randint(0, 1 << 30, ()))) for i, name in enumerate(recipe.VARIANTS)}
    results = {"git_commit": "abc1234", "training_data": {"sequences": 11},
               "training": {name: {"train_config": {"seed": 42 + len((earlier_legs or {}).get(name, []))}}
                            for name in recipe.VARIANTS}}
    if earlier_legs:
        results["start_from"] = {"file": recipe.PACK_NAME, "sha256": "0" * 64, "legs": earlier_legs}
    for name, model in models.items():
        save_checkpoint(model, work / name, trainer_state={"step": steps})
    (work / "results.json").write_text(json.dumps(results))
    return models


def test_a_pack_carries_each_trained_parameter_in_bf16_and_its_legs(tmp_path):
    work, keep = tmp_path / "work", tmp_path / "keep"
    trained = trained_work(work, steps=5)
    manifest = recipe.pack_drafters(work, keep)
    assert all(p["bytes"] <= staging.RETURNABLE_PART_BYTES for p in manifest["parts"])
    assert manifest["variants"] == {name: [{"steps": 5, "seed": 42, "commit": "abc1234", "sequences": 11}]
                                    for name in recipe.VARIANTS}
    start = recipe.read_pack(keep / recipe.PACK_NAME)
    assert recipe.steps_before(start, "dspark") == 5 and recipe.steps_before(None, "dspark") == 0
    for name in recipe.VARIANTS:
        fresh = variant(name, seed=1234)
        before = {k: p.detach().clone() for k, p in fresh.named_parameters()}
        recipe.load_packed(fresh, name, start)
        for key, p in fresh.named_parameters():
            if p.requires_grad:  # the trained value, rounded to bf16 once
                expected = dict(trained[name].named_parameters())[key].detach().to(torch.bfloat16).float()
                torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0)
            else:  # the ablation's frozen heads: the fresh model's own start, not carried
                assert name == "dflash_ablation" and key.startswith(recipe.ABLATION_FROZEN)
                torch.testing.assert_close(p.detach(), before[key], rtol=0, atol=0)
    frozen = [k for k in start["variants"]["dflash_ablation"]["tensors"] if k.startswith(recipe.ABLATION_FROZEN)]
    assert frozen == [] and "markov_head.markov_w2.weight" in start["variants"]["dspark"]["tensors"]


def test_a_second_leg_extends_the_lineage(tmp_path):
    earlier = {name: [{"steps": 7, "seed": 42, "commit": "0ld", "sequences": 11}] for name in recipe.VARIANTS}
    trained_work(tmp_path / "work", steps=3, earlier_legs=earlier)
    manifest = recipe.pack_drafters(tmp_path / "work", tmp_path / "keep")
    assert [leg["steps"] for leg in manifest["variants"]["dspark"]] == [7, 3]
    assert [leg["seed"] for leg in manifest["variants"]["dspark"]] == [42, 43]
    start = recipe.read_pack(staging.join(recipe.PACK_NAME, tmp_path / "keep"))
    assert recipe.steps_before(start, "dflash_ablation") == 10
    assert recipe.train_configs(recipe.parse(["run"]), legs_before=2)["dspark"].seed == 44


def test_a_pack_that_does_not_fit_the_run_is_refused_by_name(tmp_path):
    trained_work(tmp_path / "work", steps=2)
    recipe.pack_drafters(tmp_path / "work", tmp_path / "keep")
    start = recipe.read_pack(tmp_path / "keep" / recipe.PACK_NAME)
    torch.manual_seed(0)
    other = DSparkModel(recipe.drafter_config(fake_target(), "dspark", 2, 16), torch.randn(VOCAB, HIDDEN),
                        torch.randn(VOCAB, HIDDEN))
    with pytest.raises(ValueError, match=r"dspark's markov_rank is 8, this run builds 16"):
        recipe.load_packed(other, "dspark", start)
    start["variants"]["dspark"]["tensors"]["layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"carries 'layers.9.mlp.up_proj.weight', not a trained parameter"):
        recipe.load_packed(variant("dspark", 3), "dspark", start)
    del start["variants"]["dspark"]["tensors"]["layers.9.mlp.up_proj.weight"]
    del start["variants"]["dspark"]["tensors"]["final_norm.weight"]
    with pytest.raises(ValueError, match=r"lacks 'final_norm.weight'"):
        recipe.load_packed(variant("dspark", 3), "dspark", start)
    with pytest.raises(recipe.RecipeError, match="not a drafter pack"):
        save_checkpoint(variant("dspark", 4), tmp_path / "plain")
        recipe.read_pack(tmp_path / "plain" / "model.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "keep" / recipe.PACK_NAME).read_bytes()[:1000])
    with pytest.raises(recipe.RecipeError, match="not a safetensors file"):
        recipe.read_pack(tmp_path / "cut.safetensors")
    with pytest.raises(recipe.RecipeError, match="no such file"):
        recipe.read_pack(tmp_path / "nothing.safetensors")
    with pytest.raises(recipe.RecipeError, match="untrained holds no trained drafter; train first"):
        save_checkpoint(variant("dspark", 5), tmp_path / "untrained" / "dspark")
        (tmp_path / "untrained" / "results.json").write_text("{}")
        recipe.pack_drafters(tmp_path / "untrained", tmp_path / "keep2")


def test_the_cli_packs_and_joins_in_one_line_errors(tmp_path, capsys):
    trained_work(tmp_path / "work", steps=2)
    assert recipe.main(["pack", "--work-dir", str(tmp_path / "work"), "--keep-dir", str(tmp_path / "keep")]) == 0
    (tmp_path / "keep" / (recipe.PACK_NAME + ".part1")).unlink()
    capsys.readouterr()
    assert recipe.main(["join", "--keep-dir", str(tmp_path / "keep"), "--file", recipe.PACK_NAME]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drafters.safetensors.part1" in err and "Traceback" not in err
    assert recipe.main(["pack", "--work-dir", str(tmp_path / "none"), "--keep-dir", str(tmp_path / "k")]) == 2
    assert "results.json is missing" in capsys.readouterr().err


def test_the_trend_fits_schedule_ends_and_projects_the_goal(tmp_path, capsys):
    import smollm2_trend as trend

    slope, start = 1e-4 * (1 + torch.rand(()).item()), 1.2 + 0.1 * torch.rand(()).item()
    files = []
    for i, steps in enumerate((600, 1000, 1800)):  # the last a second leg of 800 after the first 1000
        legs = 1000 if steps == 1800 else 0
        held = [{"step": s, "total_step": legs + s, "acceptance_length": start + slope * (legs + s)}
                for s in ((steps - legs) // 2, steps - legs)]
        results = {"training": {name: {"train_config": {"steps": steps - legs}, "held_out": held}
                                for name in recipe.VARIANTS}}
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(results))
    out = tmp_path / "trend.json"
    assert trend.main([str(f) for f in files] + ["--goal", "3.0", "--out", str(out)]) == 0
    fits = json.loads(out.read_text())["variants"]["dspark"]["fits"]
    assert json.loads(out.read_text())["variants"]["dspark"]["points"] == [
        [s, pytest.approx(start + slope * s)] for s in (600, 1000, 1800)]
    assert fits["linear_in_steps"]["steps_to_goal"] == pytest.approx((3.0 - start) / slope, rel=1e-6)
    assert fits["linear_in_steps"]["residual_max"] < 1e-9 < fits["linear_in_log2_steps"]["residual_max"]
    files[0].write_text(json.dumps({"training": {"dspark": {"train_config": {"steps": 600}, "held_out": []}}}))
    capsys.readouterr()
    assert trend.main([str(f) for f in files] + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no held-out check at its end" in err
