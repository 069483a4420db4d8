"""Which start trains the SmolLM2 DSpark drafter fastest: random layers, or the target's own (issue 13)?

An A/B of the recipe's training (experiments/smollm2_dspark.py, `train_variants`: the same config,
batches, precision and held-out checks) that differs only in how the drafter's decoder layers start
(docs/dspark-algorithm.md §6.5). Every start trains on the same self-distilled sequences; recorded
per start:

- the greedy acceptance length in the engine on held-out calibration prompts every --eval-every
  steps (the recipe's held-out check, k = 7, every draft verified), the figure the goals are in;
- at the end, on sequences held out of training, the teacher-forced expected acceptance length
  tau = 1 + sum_k prod_{i<=k} (1 - TV_i) and the per-slot acceptance (docs/dspark-algorithm.md §6.3).

Meant for the GPU (a few minutes per start at the recipe's batch); it runs on the CPU too, where a
step of the recipe's size takes ~25 s, so only a smoke-sized run fits there. It ranks the starts;
the full round (more sequences and steps) is the recipe's job.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dspark.drafters.dspark import DSparkModel
from dspark.drafters.dspark.loss import metrics_to_floats
from dspark.drafters.dspark.train import TrainConfig, capture, response_loss_masks, train_step_loss
from dspark.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smollm2_dspark as recipe  # noqa: E402  (the recipe's training, data and file helpers)

REPO = recipe.REPO
STARTS = ("random", "first", "last", "spread")
ANCHORS = 128  # per held-out sequence for the teacher-forced check (all of them cost ~4x more on the CPU)


def start_layers(start: str, layers: int, target_layers: int) -> str:
    """The --init-layers of a start: the target's first or last `layers` layers, `layers` spread
    evenly from layer 0, or none (random: the default start)."""
    if start == "random":
        return ""
    if layers > target_layers:
        raise ValueError(f"--layers={layers}: more than the target's {target_layers} layers to start from")
    ids = {"first": range(layers), "last": range(target_layers - layers, target_layers),
           "spread": [i * target_layers // layers for i in range(layers)]}[start]
    return ",".join(map(str, ids))


@torch.no_grad()
def teacher_forced(model: DSparkModel, target, sequences, masks) -> dict:
    """tau and per-slot acceptance over `sequences`, weighted by their supervised tokens, on the
    same ANCHORS random valid anchors of each sequence for every start."""
    cfg = TrainConfig(batch_size=1, num_anchors=ANCHORS, anchor_chunk=64)
    model.eval()
    tau, weight, per_slot = 0.0, 0, 0.0
    for start in range(0, len(sequences), target.max_slots):
        batch, batch_masks = sequences[start : start + target.max_slots], masks[start : start + target.max_slots]
        captured = capture(target, batch, model.config.target_layer_ids)
        _, metrics = train_step_loss(model, captured, batch, batch_masks, cfg, torch.Generator().manual_seed(0))
        metrics = metrics_to_floats(metrics)
        n = sum(int(m.sum()) for m in batch_masks)
        tau += metrics["tau"] * n
        per_slot = per_slot + np.array(metrics["accept"]) * n
        weight += n
    return {"tau": round(tau / weight, 4), "accept_per_slot": [round(float(x), 4) for x in per_slot / weight]}


def run(args, recipe_argv: list[str]) -> dict:
    from dspark.targets.gguf_assets import file_sha256, find_smollm2_gguf
    from dspark.targets.llama import weights_to

    starts = args.starts.split(",")
    for name in starts:
        if name not in STARTS:
            raise ValueError(f"--starts: {name!r} is not one of {', '.join(STARTS)}")
    recipe_args = recipe.parse(["run", *recipe_argv])
    device = torch.device(recipe_args.device)
    answered, arrays, _ = recipe.load_sequences(Path(args.sequences))
    prompt_sets = recipe.load_prompt_sets(Path(recipe_args.data))
    if args.max_length:  # short sequences only: a CPU-sized run
        kept = [(i, a) for i, a in zip(answered, arrays) if len(a) <= args.max_length]
        answered, arrays = [i for i, _ in kept], [a for _, a in kept]
    sequences = [torch.from_numpy(a.astype(np.int64)) for a in arrays]
    masks = response_loss_masks([prompt_sets["train"][i] for i in answered], sequences)
    if not 0 < args.held_out_sequences < len(sequences):
        raise ValueError(f"--held-out-sequences={args.held_out_sequences}: {args.sequences} holds {len(sequences)} "
                         f"sequences (of at most --max-length={args.max_length} tokens, 0 = any)")
    held = len(sequences) - args.held_out_sequences  # the last ones, whatever --train-prompts keeps
    if recipe_args.anchor_bucket < 0 or recipe_args.length_bucket < 0:  # one shape for the data, as the recipe
        buckets = recipe.static_buckets(sequences, masks, recipe_args.num_anchors)
        recipe_args.anchor_bucket, recipe_args.length_bucket = (b if a < 0 else a for a, b in zip(
            (recipe_args.anchor_bucket, recipe_args.length_bucket), buckets))
    cut = min(held, recipe_args.train_prompts) if recipe_args.train_prompts else held
    held_prompts = prompt_sets["calibration"][: recipe_args.held_out_prompts]

    gguf = Path(recipe_args.gguf) if recipe_args.gguf else find_smollm2_gguf()
    config, cpu_weights = recipe.read_gguf(str(gguf))
    longest = max(len(s) for s in sequences)
    max_seq = max(longest, max(len(p) for p in held_prompts) + recipe_args.held_out_tokens + 2 * recipe.BLOCK) + 2
    target = recipe.recipe_target(config, weights_to(cpu_weights, device), recipe_args, recipe_args.batch_size, max_seq)

    out, work = Path(args.out), recipe._ignored_dir(Path(recipe_args.work_dir))
    results = {**provenance(device), "settings": vars(args), "recipe_settings": vars(recipe_args),
               "target": {"gguf": gguf.name, "sha256": file_sha256(gguf)},
               "data": {"train_sequences": cut, "held_out_sequences": args.held_out_sequences,
                        "supervised_tokens": int(sum(int(m.sum()) for m in masks[:cut])),
                        "held_out_prompts": len(held_prompts)},
               "starts": {}}
    for name in starts:
        recipe_args.init_layers = start_layers(name, recipe_args.layers, config.num_layers)
        shutil.rmtree(work / name, ignore_errors=True)  # never resume a checkpoint of other settings
        trained: dict = {}
        began = time.time()
        model = recipe.train_variants(recipe_args, target, sequences[:cut], masks[:cut], held_prompts, work / name,
                                      trained, lambda: None, deadline=float("inf"), variants=("dspark",))["dspark"]
        entry = trained["training"]["dspark"]
        results["starts"][name] = {"init_layers": recipe_args.init_layers, "train_config": entry["train_config"],
                                   "held_out": entry["held_out"], "seconds": round(time.time() - began, 1),
                                   "teacher_forced": teacher_forced(model, target, sequences[held:], masks[held:])}
        print(f"{name}: {results['starts'][name]['held_out'][-1]} {results['starts'][name]['teacher_forced']}")
        recipe.write_json_atomic(out, results)
    return results


def parse(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """(this script's options, the rest: passed to the recipe's `run` parser, e.g. --steps 300)."""
    ap = argparse.ArgumentParser(prog="smollm2_init_ab", description=__doc__.splitlines()[0],
                                 epilog="Other options go to the recipe (smollm2_dspark.py run --help): "
                                        "--steps, --batch-size, --eval-every, --train-prompts, --work-dir ...")
    ap.add_argument("--starts", default="random,first,last", help=f"comma-separated, of {', '.join(STARTS)}")
    ap.add_argument("--sequences", default=str(REPO / "experiments/data/smollm2_selfdistil_58278.npz"))
    ap.add_argument("--held-out-sequences", type=int, default=32,
                    help="the file's last sequences, kept out of training for the teacher-forced check")
    ap.add_argument("--max-length", type=int, default=0, help="keep only sequences of at most this many tokens (0: all)")
    ap.add_argument("--out", default=str(REPO / "experiments/results/h200/smollm2_init_ab.json"))
    return ap.parse_known_args(argv)


def main(argv=None) -> int:
    args, rest = parse(argv)
    try:
        run(args, rest)
    except (ValueError, FileNotFoundError, recipe.RecipeError) as error:
        print(f"smollm2_init_ab: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
