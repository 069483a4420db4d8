"""`dspark sweep`: tokens/s against acceptance length.

A grid over forced acceptance length (synthetic acceptance, vLLM's semantics), k, batch size and
verification policy on one target. Every point runs the real pipeline (draft, full-width verify,
accept, commit); only the acceptance decision is forced. Plain decoding (k = 0) is measured at each
batch size as the baseline for speedups. Each point is measured --repeats times (phases on one
prefill, or fresh engines with --per-point); its numbers pool the repeats and tokens_per_s_std is
the spread between them (the plot's error bars).

Output (in --out, default runs/sweep-<target>): sweep.json, sweep.csv and sweep.png, each written
atomically (temporary file + rename), after every measured (batch, k) so an interruption loses little.
sweep.json schema:
  {"schema": "dspark.sweep/1",
   "meta": {dspark.provenance fields ("device", "device_name", "torch", "git_commit", "command",
            "created", ...), "target", "context", "max_tokens", "warmup_steps", "settings",
            "read_GBps" (the device's measured read bandwidth: the floor's yardstick)},
   "points": [{"key", "batch", "k", "policy", "al_target" (null for plain decoding),
               "al_measured", "tokens_per_s", "tokens_per_s_std", "tokens_per_s_repeats", "repeats",
               "tpot_ms", "p50_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
               "step_ms_p50", "step_ms_p90", "step_ms_mean",
               "split_ms": {"draft", "verify", "accept", "commit"} (mean per step),
               "steps" (per repeat), "output_tokens", "per_position_acceptance",
               "spec_decode_acceptance_length", "spec_decode_acceptance_rate" (vLLM bench serve's
               names: AL, and accepted / drafted tokens in %),
               "settings" (everything besides the key that the numbers depend on),
               for K3 presets also "floor_ms" (bandwidth floor of the step at the device's measured
               read bandwidth, "floor_device") and "roofline_fraction" (floor / measured step time)}]}
The CSV has one row per point with the scalar fields (split_ms flattened to draft_ms, ...) and the
provenance (device, device_name, torch, git_commit, command) repeated on every row.

Rerunning into an existing --out reuses the points measured with the same settings (an
interrupted sweep resumes) and refuses when a setting changed; --resume re-measures the points
whose settings differ, --fresh starts over. A torn sweep.json is set aside, never overwritten.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .build import build_target
from .targets import eos_ids
from .config import MAX_SPECULATIVE_TOKENS, SamplingParams, SpecConfig
from .drafters.uniform import UniformDrafter
from .engine import Engine
from .files import atomic_path, write_atomic
from .metrics import SpecMetrics
from .progress import progress
from .provenance import provenance
from .sampling import acceptance_length_to_rates, conditional_rates
from .threads import one_cpu_thread
from . import checks

SCHEMA = "dspark.sweep/1"
run_meta = provenance  # the name the vLLM sweep backend imports
POLICIES = ("fixed", "threshold", "scheduler")  # SpecConfig.verify_policy
# Where a figure draws the bandwidth floor's tokens/s beside the measured curve: when every step
# reached at least this fraction of its floor (above ~4x the measured curve, the floor would flatten it).
FLOOR_DRAWN_FROM = 0.25


def point_key(batch: int, k: int, policy: str, al: float | None) -> str:
    return f"b{batch}-k{k}-{policy}-" + ("plain" if al is None else f"al{al:g}")


def measure_point(target, *, batch: int, k: int, al: float | None, policy: str, context: int,
                  max_tokens: int, warmup_steps: int, seed: int, repeats: int = 1) -> dict:
    """Run one grid point on `target` `repeats` times (a fresh engine and prefill each) and
    return its row."""
    if al is None:
        spec = SpecConfig(num_speculative_tokens=0, seed=seed)
    else:
        spec = SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                          synthetic_acceptance_length=al, verify_policy=policy, seed=seed)
    # With a confidence policy the drafter reports the synthetic conditional rates as its
    # confidences: exactly calibrated, so the policy's choices are the ones it would make for a
    # drafter whose acceptance really follows that curve.
    confidence = conditional_rates(acceptance_length_to_rates(al, k)) if al is not None else None
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, ignore_eos=True)

    # Each run's first `warmup_steps` steps (allocation, caches, compilation, clock ramp-up)
    # stay out of the timings. One prefill per run: at long contexts prefill dominates a run.
    runs = []
    for _ in range(repeats):
        drafter = UniformDrafter(target.vocab_size, confidence) if spec.max_k else None
        engine = Engine(target, drafter, spec, eos_token_ids=eos_ids(target))
        warm_tokens = warmup_steps * (spec.max_k + 1)
        engine.generate(prompts, SamplingParams(**{**params.__dict__, "max_tokens": max_tokens + warm_tokens}))
        runs.append((engine.metrics, min(warmup_steps, len(engine.metrics.step_seconds) - 1)))
    return _row(runs, batch=batch, k=k if al is not None else 0, al=al, policy=policy)


def _percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile: always one of the measured values."""
    return float(np.percentile(values, q, method="inverted_cdf"))


def _row(runs: list[tuple[SpecMetrics, int]], *, batch: int, k: int, al: float | None, policy: str) -> dict:
    """One point from repeated runs, each (metrics, warm-up steps to leave out): step timings
    pooled over the runs, tokens/s per run for the spread."""
    steps, tokens, rates = [], [], []
    for m, warm in runs:
        steps += m.step_seconds[warm:]
        tokens += m.step_tokens[warm:]
        rates.append(sum(m.step_tokens[warm:]) / sum(m.step_seconds[warm:]))
    decode_s, decode_tokens = sum(steps), sum(tokens)
    # Per step, the time per output token of one request (vLLM's TPOT, without the first token).
    tpot = [1e3 * s * batch / n for s, n in zip(steps, tokens)]
    drafted = sum(m.num_draft_tokens for m, _ in runs)
    accepted = sum(m.num_accepted_tokens for m, _ in runs)
    drafts = sum(m.num_drafts for m, _ in runs)
    al_measured = 1.0 + accepted / drafts if drafts else 1.0
    per_position = [sum(m.accepted_per_position[i] for m, _ in runs if i < len(m.accepted_per_position)) / drafts
                    for i in range(max(len(m.accepted_per_position) for m, _ in runs))] if drafts else []
    steps_total = sum(len(m.step_seconds) for m, _ in runs)
    return {
        "key": point_key(batch, k, policy, al),
        "batch": batch,
        "k": k,
        "policy": policy,
        "al_target": al,
        "al_measured": al_measured,
        "spec_decode_acceptance_length": al_measured,
        "spec_decode_acceptance_rate": 100.0 * accepted / drafted if drafted else 0.0,
        "tokens_per_s": decode_tokens / decode_s,
        "tokens_per_s_std": statistics.stdev(rates) if len(rates) > 1 else 0.0,
        "tokens_per_s_repeats": rates,
        "repeats": len(runs),
        "tpot_ms": 1e3 * decode_s / (decode_tokens / batch),
        "p50_tpot_ms": _percentile(tpot, 50),
        "p90_tpot_ms": _percentile(tpot, 90),
        "p99_tpot_ms": _percentile(tpot, 99),
        "step_ms_p50": 1e3 * statistics.median(steps),
        "step_ms_p90": 1e3 * _percentile(steps, 90),
        "step_ms_mean": 1e3 * decode_s / len(steps),
        "split_ms": {p: 1e3 * sum(m.phase_seconds[p] for m, _ in runs) / steps_total
                     for p in ("draft", "verify", "accept", "commit")},
        "steps": len(steps) // len(runs),
        "output_tokens": sum(m.num_output_tokens for m, _ in runs),
        "per_position_acceptance": per_position,
    }


def measure_phases(target, *, batch: int, k: int, als: list[float], context: int, steps: int,
                   warmup_steps: int, seed: int, repeats: int = 1, on_phase=None) -> list[dict]:
    """Every point of one (batch, k) from one prefill per repeat: the requests stay live and the
    engine's acceptance is switched between phases of `warmup_steps + steps` steps (plain
    decoding first, then each forced AL). For long contexts, where a prefill costs far more than
    a phase, this is the affordable way; the context grows by the phases' few hundred tokens
    meanwhile. Repeating the whole cycle (rather than each phase in a row) spreads any drift of
    the machine over every AL alike. `on_phase()`, when given, is called after each phase."""
    spec = SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                      synthetic_acceptance_length=float(k + 1), seed=seed)
    runs: dict[float | None, list] = {al: [] for al in [None, *als]}
    for _ in range(repeats):
        # A fresh prefill per repeat: the context does not grow with the repeats.
        engine = Engine(target, UniformDrafter(target.vocab_size), spec, eos_token_ids=eos_ids(target))
        gen = torch.Generator().manual_seed(seed)
        budget = target.max_seq_len - context - 1
        for _ in range(batch):
            engine.add_request(torch.randint(0, target.vocab_size, (context,), generator=gen).tolist(),
                               SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=budget))
        engine.step()  # prefill (and one step), outside every phase
        for al in runs:
            engine.drain()  # a step launched ahead belongs to the phase before
            if al is None:
                engine.set_acceptance(SpecConfig(num_speculative_tokens=0, seed=seed))
            else:
                engine.set_acceptance(SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                                                 synthetic_acceptance_length=al, seed=seed))
            engine.metrics = SpecMetrics()
            for _ in range(warmup_steps + steps):
                engine.step()
            runs[al].append((engine.metrics, warmup_steps))
            if on_phase is not None:
                on_phase()
    return [_row(r, batch=batch, k=0 if al is None else k, al=al, policy="fixed") for al, r in runs.items()]


def read_bandwidth_gbps(device: str, megabytes: int) -> float:
    """The device's read bandwidth (a float32 sum over a buffer far larger than its caches;
    median of 7): the yardstick of the floors written beside the results."""
    buf = torch.ones(megabytes * 2**18, device=device)
    sync = torch.cuda.synchronize if buf.is_cuda else (lambda: None)
    times = []
    for _ in range(8):
        sync()
        start = time.perf_counter()
        buf.sum()
        sync()
        times.append(time.perf_counter() - start)
    return buf.numel() * 4 / statistics.median(times[1:]) / 1e9


def add_floor(point: dict, target_name: str, context: int, device_label: str, read_gbps: float) -> dict:
    """For K3-shaped targets: the bandwidth floor of the same step on this run's device at its
    measured read bandwidth (dspark.roofline, replay-style KDA state, no draft cost: the sweep's
    drafter costs nothing) and the measured step's fraction of it."""
    from .roofline import GPU, step_cost, step_time
    from .targets.kimi_k3.config import PRESETS

    cfg = PRESETS.get(target_name)
    if cfg is None:
        return point
    cost = step_cost(cfg, batch=point["batch"], tokens_per_request=point["k"] + 1, context=context, kda_state="replay")
    floor_ms = 1e3 * step_time(cost, GPU(device_label, read_gbps * 1e9))
    return {**point, "floor_ms": floor_ms, "floor_device": f"{device_label} at {read_gbps:.0f} GB/s",
            "roofline_fraction": floor_ms / point["step_ms_mean"]}


def grid(ks, batches, als, policies) -> list[tuple[int, int, float | None, str]]:
    points = []
    for batch in batches:
        points.append((batch, 0, None, "fixed"))
        for k in ks:
            for policy in policies:
                points += [(batch, k, al, policy) for al in als]
    return points


def write_results(out: Path, meta: dict, points: list[dict]) -> None:
    """sweep.json and sweep.csv, each replaced in one rename."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "sweep.json", json.dumps({"schema": SCHEMA, "meta": meta, "points": points}, indent=1))
    provenance_fields = {k: meta[k] for k in ("device", "device_name", "torch", "git_commit", "command")}
    scalar = [f for f in points[0] if not isinstance(points[0][f], (dict, list))]
    fields = scalar + [f"{p}_ms" for p in ("draft", "verify", "accept", "commit")] + list(provenance_fields)
    with atomic_path(out / "sweep.csv") as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for p in points:
            w.writerow({**p, **{f"{ph}_ms": v for ph, v in p["split_ms"].items()}, **provenance_fields})


def plot(out: Path, meta: dict, points: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw_tokens_vs_al([(meta, points)])
    path = out / "sweep.png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png", bbox_inches="tight")
    plt.close(fig)
    return path


def run_title(meta: dict) -> str:
    """What tells one sweep from another: target, device, commit and the day it ran."""
    commit = str(meta.get("git_commit") or "no commit")[:7]
    day = str(meta.get("created") or "")[:10] or "undated"
    return f"{meta['target']} on {meta['device_name']}, {commit}, {day}"


def draw_tokens_vs_al(runs: list[tuple[dict, list[dict]]]):
    """A figure with one row per sweep run (titled by run_title) and one panel per batch size:
    tokens/s against the measured AL (error bars: the spread between repeats), plain decoding as
    a labelled line, and for K3-shaped runs the bandwidth floor's tokens/s as its own dashed line
    with the measured fraction of it on a second axis, where the run comes close enough to its
    floor for both to share a scale (FLOOR_DRAWN_FROM); otherwise a note gives the floor's range.
    Each row's legend sits right of its last panel, off the data. Reads old result files too (no
    repeats, floor_ms_h200)."""
    import matplotlib.pyplot as plt

    batches = [sorted({p["batch"] for p in pts}) for _, pts in runs]
    cols = max(len(b) for b in batches)
    fig, axes = plt.subplots(len(runs), cols, figsize=(4.0 * cols + 2.2, 3.4 * len(runs)), squeeze=False)
    for row, ((meta, pts), run_batches) in enumerate(zip(runs, batches)):
        legend: dict[str, object] = {}
        for col in range(cols):
            ax = axes[row][col]
            if col >= len(run_batches):
                ax.set_visible(False)
                continue
            _draw_panel(ax, [p for p in pts if p["batch"] == run_batches[col]])
            ax.set_title(f"{run_title(meta)}\nbatch {run_batches[col]}", fontsize=8)
            for handle, label in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        last = axes[row][len(run_batches) - 1]
        right_axis = any(other is not last and other.bbox.bounds == last.bbox.bounds for other in fig.axes)
        last.legend(legend.values(), legend.keys(), fontsize=7, loc="upper left", borderaxespad=0.0,
                    bbox_to_anchor=(1.2 if right_axis else 1.03, 1.0))  # past the right axis's label
    fig.tight_layout()
    return fig


def _draw_panel(ax, pts: list[dict]) -> None:
    plain = next((p for p in pts if p["al_target"] is None), None)
    spec = [p for p in pts if p["al_target"] is not None]
    fractions = [p.get("roofline_fraction") for p in spec]
    has_floor = bool(spec) and all(f is not None for f in fractions)
    draw_floor = has_floor and min(fractions) >= FLOOR_DRAWN_FROM
    fraction_ax = ax.twinx() if draw_floor else None
    for k in sorted({p["k"] for p in spec}):
        s = sorted((p for p in spec if p["k"] == k), key=lambda p: p["al_measured"])
        x = [p["al_measured"] for p in s]
        line = ax.errorbar(x, [p["tokens_per_s"] for p in s], yerr=[p.get("tokens_per_s_std", 0.0) for p in s],
                           fmt="o-", capsize=3, label=f"k={k} measured")[0]
        if draw_floor:
            # tokens per step over the floor's step time = measured tokens/s / (floor / measured time)
            ax.plot(x, [p["tokens_per_s"] / p["roofline_fraction"] for p in s], "--", lw=1.4,
                    color=line.get_color(), label=f"k={k} bandwidth floor")
            fraction_ax.plot(x, [100 * p["roofline_fraction"] for p in s], ":", marker="x", ms=4,
                             color=line.get_color(), alpha=0.7, label=f"k={k} % of floor (right axis)")
    if plain is not None:
        ax.axhline(plain["tokens_per_s"], ls="-.", lw=1.2, color="gray", label="plain decoding (k=0)")
    if fraction_ax is not None:
        fraction_ax.set_ylabel("% of bandwidth floor reached", fontsize=8)
        fraction_ax.set_ylim(0, 110)
        # the row's legend reads this panel's handles: the right axis's lines join them as proxies
        for handle, label in zip(*fraction_ax.get_legend_handles_labels()):
            ax.plot([], [], ":", marker="x", ms=4, color=handle.get_color(), label=label)
    elif has_floor:
        floors = [p["tokens_per_s"] / p["roofline_fraction"] for p in spec]
        ax.text(0.02, 0.97, f"bandwidth floor {min(floors):,.0f}-{max(floors):,.0f} tokens/s,\n"
                f"{100 * min(fractions):.2g}-{100 * max(fractions):.2g}% of it reached: off this scale",
                transform=ax.transAxes, va="top", fontsize=7, color="dimgray")
    floor_device = next((p.get("floor_device") for p in pts if p.get("floor_device")), None)
    if draw_floor and floor_device:
        ax.text(0.98, 0.02, f"floor: {floor_device}", transform=ax.transAxes, ha="right", fontsize=6, color="dimgray")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("measured acceptance length")
    ax.set_ylabel("tokens/s (all requests)")
    ax.grid(alpha=0.3)


def not_monotonic(points: list[dict]) -> list[str]:
    """Keys of points whose tokens/s falls below the previous AL's of the same (batch, k) by
    more than both error bars together: a curve the repeats have not settled."""
    bad = []
    for batch, k in sorted({(p["batch"], p["k"]) for p in points if p["al_target"] is not None}):
        s = sorted((p for p in points if (p["batch"], p["k"]) == (batch, k) and p["al_target"] is not None),
                   key=lambda p: p["al_target"])
        for a, b in zip(s, s[1:]):
            if b["tokens_per_s"] + b.get("tokens_per_s_std", 0) < a["tokens_per_s"] - a.get("tokens_per_s_std", 0):
                bad.append(b["key"])
    return bad


def _floats(flag: str, text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated numbers") from None


def _ints(flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers") from None


def parse_grid(args) -> tuple[list[int], list[int], list[float], list[str]]:
    """--k, --batch, --al, --policy as lists, checked before anything is built or measured,
    with the other numeric flags."""
    ks, batches, als = _ints("--k", args.k), _ints("--batch", args.batch), _floats("--al", args.al)
    policies = [s for s in args.policy.split(",") if s]
    if not (ks and batches and als and policies):
        raise ValueError("--k, --batch, --al and --policy each need at least one value")
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r}: each policy must be one of {', '.join(POLICIES)}")
    for k in ks:
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--k {k}: each k must be in [1, {MAX_SPECULATIVE_TOKENS}] (plain decoding is always measured)")
    for b in batches:
        if b < 1:
            raise ValueError(f"--batch {b}: each batch size must be >= 1")
    for al in als:
        if not 1.0 <= al <= min(ks) + 1:
            raise ValueError(f"--al {al:g}: each acceptance length must be in [1, k + 1] = [1, {min(ks) + 1}] "
                             f"for --k {min(ks)} (a step emits at most k drafts + 1 token)")
    for flag, value in (("--repeats", args.repeats), ("--phase-steps", args.phase_steps), ("--context", args.context),
                        ("--max-tokens", args.max_tokens)):
        checks.at_least(flag, value)  # None: the device's default
    checks.at_least("--warmup-steps", args.warmup_steps, 0)
    if args.fresh and args.resume:
        raise ValueError("--fresh and --resume exclude each other")
    return ks, batches, als, policies


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="default: k3-slice when CUDA is present, else k3-tiny")
    p.add_argument("-k", "--k", default="7", help=f"comma-separated k values, each in [1, {MAX_SPECULATIVE_TOKENS}]")
    p.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--al", default="1,2,3,4,5,6,7,8", help="comma-separated forced acceptance lengths, each <= k + 1")
    p.add_argument("--policy", default="fixed", help=f"comma-separated verification policies: {', '.join(POLICIES)}")
    p.add_argument("--context", type=int, default=None, help="prompt length (default 32 on CPU, 8192 on CUDA)")
    p.add_argument("--max-tokens", type=int, default=None, help="--per-point: tokens per request (default 32 CPU / 64 CUDA)")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps of each point left out of the timings")
    p.add_argument("--repeats", type=int, default=3, help="measurements of each point (the error bars)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default runs/sweep-<target>)")
    p.add_argument("--per-point", action="store_true",
                   help="a fresh engine and prefill for every point (needed for policies other than "
                        "fixed); the default measures all ALs of a (batch, k) on one prefilled context, "
                        "in phases of --warmup-steps + --phase-steps steps")
    p.add_argument("--phase-steps", type=int, default=6)
    p.add_argument("--fresh", action="store_true", help="start over: ignore the points already in --out")
    p.add_argument("--resume", action="store_true",
                   help="reuse the points in --out measured with the same settings and re-measure the others")


def load_previous(out: Path) -> list[dict]:
    """The points of an earlier sweep.json in `out` ([] when there is none). A file that does
    not read as a sweep result (torn by a killed write, or something else) is set aside as
    sweep.json.corrupt-<UTC time> and reported on stderr; it is never overwritten."""
    path = out / "sweep.json"
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA or not isinstance(data.get("points"), list):
            raise ValueError(f"not a {SCHEMA} result")
        return data["points"]
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        aside = path.with_name(f"sweep.json.corrupt-{stamp}")
        path.rename(aside)
        print(f"dspark sweep: warning: {path} is not a readable sweep result ({e}); set aside as {aside.name}",
              file=sys.stderr)
        return []


def reusable_points(previous: list[dict], settings: dict, out: Path, resume: bool) -> dict[str, dict]:
    """The earlier points measured with exactly `settings`, by key. Without `resume`, any point
    measured otherwise stops the sweep with the first differing setting named."""
    same = {p["key"]: p for p in previous if p.get("settings") == settings}
    if resume or len(same) == len(previous):
        return same
    other = next(p for p in previous if p.get("settings") != settings)
    stored = other.get("settings") or {}
    name = next((n for n in settings if stored.get(n, "not recorded") != settings[n]), "settings")
    raise ValueError(f"{out / 'sweep.json'} holds points measured with {name}={stored.get(name, 'not recorded')!r}, "
                     f"this run has {name}={settings[name]!r}: pass --resume to re-measure those points, "
                     f"--fresh to start over, or another --out")


def main(args) -> int:
    ks, batches, als, policies = parse_grid(args)  # before anything loads
    if not args.per_point and policies != ["fixed"]:
        raise ValueError(f"--policy {args.policy}: policies other than fixed need --per-point")
    device = checks.device(args.device)
    with one_cpu_thread(device):
        return _run(args, device, ks, batches, als, policies)


def _run(args, device: str, ks, batches, als, policies) -> int:
    on_cuda = torch.device(device).type == "cuda"
    target_name = args.target or ("k3-slice" if on_cuda else "k3-tiny")
    context = args.context if args.context is not None else (8192 if on_cuda else 32)
    max_tokens = args.max_tokens if args.max_tokens is not None else (64 if on_cuda else 32)
    out = checks.writable_folder("--out", args.out or f"runs/sweep-{target_name}")
    settings = {"target": target_name, "device": torch.device(device).type, "context": context,
                "warmup_steps": args.warmup_steps, "repeats": args.repeats, "seed": args.seed,
                **({"mode": "per-point", "max_tokens": max_tokens} if args.per_point
                   else {"mode": "phases", "phase_steps": args.phase_steps})}
    previous = [] if args.fresh else load_previous(out)
    done = reusable_points(previous, settings, out, args.resume)
    if args.per_point:
        seq_len = context + max_tokens + (max(ks) + 1) * (args.warmup_steps + 1) + 2
    else:
        seq_len = context + (len(als) + 1) * (args.warmup_steps + args.phase_steps) * (max(ks) + 1) + (max(ks) + 1) + 2
    try:
        target = build_target(target_name, max_slots=max(batches), max_seq_len=seq_len, device=device, seed=args.seed)
    except ValueError as e:
        if "max_seq_len" not in str(e):
            raise
        raise ValueError(f"--context {context} and the grid need a {seq_len}-token context, more than --target "
                         f"{target_name} takes ({e}): use a shorter --context, fewer --al values or fewer "
                         f"{'--max-tokens' if args.per_point else '--phase-steps'}") from None
    read_gbps = read_bandwidth_gbps(device, 1024 if on_cuda else 64)
    meta = provenance(device, target=target_name, context=context, max_tokens=max_tokens,
                      warmup_steps=args.warmup_steps, settings=settings, read_GBps=read_gbps)
    wanted = [point_key(b, k, pol, al) for b, k, al, pol in grid(ks, batches, als, policies)]
    reused = [key for key in wanted if key in done]
    print(f"reused {len(reused)} of {len(wanted)} points from {out / 'sweep.json'}" if previous else
          f"measuring {len(wanted)} points into {out}")

    def finish(p: dict) -> dict:
        return {**add_floor(p, target_name, context, meta["device_name"], read_gbps), "settings": settings}

    def save(points: list[dict]) -> None:  # after every measurement, so an interruption loses little
        write_results(out, meta, points)

    if args.per_point:
        points = _sweep_points(target, target_name, grid(ks, batches, als, policies), done, save, finish, args,
                               context, max_tokens)
    else:
        points = _sweep_phases(target, target_name, batches, ks, als, done, save, finish, args, context)
    save(points)
    png = plot(out, meta, points)
    _print_table(points)
    for key in not_monotonic(points):
        print(f"dspark sweep: warning: {key}: tokens/s below the previous AL's beyond the error bars; "
              f"more --repeats or --phase-steps would settle it", file=sys.stderr)
    print(f"wrote {out / 'sweep.json'}, {out / 'sweep.csv'}, {png}")
    return 0


def _sweep_points(target, target_name, points_todo, done, save, finish, args, context, max_tokens) -> list[dict]:
    """--per-point: fresh engines and prefills for each grid point not already done."""
    points = [done[point_key(b, k, pol, al)] for b, k, al, pol in points_todo if point_key(b, k, pol, al) in done]
    todo = [pt for pt in points_todo if point_key(pt[0], pt[1], pt[3], pt[2]) not in done]
    with progress(len(todo), desc=f"sweep {target_name}", unit="point") as bar:
        for batch, k, al, policy in todo:
            point = measure_point(target, batch=batch, k=k, al=al, policy=policy, context=context,
                                  max_tokens=max_tokens, warmup_steps=args.warmup_steps, seed=args.seed,
                                  repeats=args.repeats)
            points.append(finish(point))
            save(points)
            bar.update(1)
    return points


def _sweep_phases(target, target_name, batches, ks, als, done, save, finish, args, context) -> list[dict]:
    """Default: every AL of a (batch, k) in phases on one prefill, for each pair not fully done."""
    points = list(done.values())
    pending = [(b, k) for b in batches for k in ks
               if any(point_key(b, k, "fixed", al) not in done for al in als) or point_key(b, 0, "fixed", None) not in done]
    # A (batch, k) measures plain decoding and every AL, each point in `repeats` phases: the bar
    # ticks per phase.
    points_todo = len(pending) * (len(als) + 1)
    with progress(points_todo * args.repeats, desc=f"sweep {target_name} ({points_todo} points x {args.repeats} "
                  "repeats)", unit="phase") as bar:
        for batch, k in pending:
            rows = measure_phases(target, batch=batch, k=k, als=als, context=context, steps=args.phase_steps,
                                  warmup_steps=args.warmup_steps, seed=args.seed, repeats=args.repeats,
                                  on_phase=bar.update)
            fresh = [finish(r) for r in rows]
            points = [p for p in points if p["key"] not in {r["key"] for r in fresh}] + fresh
            save(points)
    return points


def _print_table(points: list[dict]) -> None:
    print(f"{'batch':>5} {'k':>3} {'AL set':>7} {'AL got':>7} {'tok/s':>9} {'+-':>6} {'TPOT ms':>8} {'p50 ms':>7} {'p90 ms':>7}")
    for p in sorted(points, key=lambda p: (p["batch"], p["k"], p["al_target"] or 0)):
        al = "plain" if p["al_target"] is None else f"{p['al_target']:g}"
        print(f"{p['batch']:>5} {p['k']:>3} {al:>7} {p['al_measured']:>7.2f} {p['tokens_per_s']:>9.1f} "
              f"{p['tokens_per_s_std']:>6.1f} {p['tpot_ms']:>8.2f} {p['p50_tpot_ms']:>7.2f} {p['p90_tpot_ms']:>7.2f}")


if __name__ == "__main__":  # pragma: no cover
    from .cli import main as cli_main

    raise SystemExit(cli_main(["sweep", *sys.argv[1:]]))
