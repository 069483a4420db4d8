"""Held-out acceptance length against training steps, from the SmolLM2 rounds' results (issue 13).

Each complete schedule gives one point: the held-out AL at its last step (a leg counted from the first
leg's start: total_step). On those points it fits two curves and says at how many steps each reaches
--goal: a line in steps (the optimistic reading, since every schedule so far ends lower per step than
the last) and a line in log2(steps) (the pessimistic one). Both are extrapolations, labelled as such,
not measurements. Only points with the same data and start compare: pass results of the same recipe.

    python experiments/smollm2_trend.py experiments/results/h200/smollm2_dspark_round4.json \\
        experiments/results/h200/smollm2_dspark.json experiments/results/h200/smollm2_dspark_round6_partial.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from dspark.files import write_atomic  # noqa: E402
from dspark.provenance import provenance  # noqa: E402


def schedule_ends(path: Path, variant: str) -> tuple[int, float]:
    """(steps counted over every leg, held-out AL) at the end of the file's schedule."""
    results = json.loads(path.read_text())
    try:
        training = results["training"][variant]
    except KeyError:
        raise ValueError(f"{path}: no training of {variant!r}") from None
    steps = training["train_config"]["steps"]
    last = [h for h in training["held_out"] if h["step"] == steps]
    if not last:
        raise ValueError(f"{path}: {variant}'s schedule of {steps} steps has no held-out check at its end")
    return last[0].get("total_step", steps), float(last[0]["acceptance_length"])


def fit(points: list[tuple[int, float]], goal: float) -> dict:
    steps = np.array([p[0] for p in points], dtype=float)
    al = np.array([p[1] for p in points])
    fits = {}
    for name, x in (("linear_in_steps", steps), ("linear_in_log2_steps", np.log2(steps))):
        slope, intercept = np.polyfit(x, al, 1)
        reach = (goal - intercept) / slope if slope > 0 else math.inf
        at = reach if name == "linear_in_steps" else 2.0 ** reach
        fits[name] = {"slope": float(slope), "intercept": float(intercept),
                      "residual_max": float(np.max(np.abs(slope * x + intercept - al))),
                      "steps_to_goal": float(at) if math.isfinite(at) else None}
    return fits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="smollm2_trend", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results JSONs of experiments/smollm2_dspark.py")
    ap.add_argument("--goal", type=float, default=2.9,
                    help="held-out AL to project to (default 2.9: round 5's HumanEval greedy AL ran 0.1 above "
                         "its held-out AL, and the issue's goal is 3.0)")
    ap.add_argument("--out", default=str(REPO / "experiments/results/cpu/smollm2_trend.json"))
    args = ap.parse_args(argv)
    try:
        report = {**provenance("cpu"), "goal_held_out_al": args.goal, "sources": args.results, "variants": {}}
        for variant in ("dspark", "dflash_ablation"):
            points = sorted(schedule_ends(Path(p), variant) for p in args.results)
            if len({s for s, _ in points}) < 2:
                raise ValueError("needs schedules of at least two lengths")
            report["variants"][variant] = {"points": points, "fits": fit(points, args.goal)}
    except (OSError, ValueError, KeyError) as error:
        print(f"smollm2_trend: error: {error}", file=sys.stderr)
        return 2
    write_atomic(args.out, json.dumps(report, indent=1) + "\n")
    for variant, v in report["variants"].items():
        line = ", ".join(f"{s} steps {a:.3f}" for s, a in v["points"])
        print(f"{variant}: {line}")
        for name, f in v["fits"].items():
            print(f"  {name}: held-out AL {args.goal} at {f['steps_to_goal'] or math.inf:,.0f} steps "
                  f"(max residual {f['residual_max']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
