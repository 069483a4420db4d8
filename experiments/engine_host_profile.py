"""Where a batch-1 engine step spends its time besides the GPU's work (issue 12).

The sweep's plain step took 3.33 ms where the same target step replayed alone took 2.80 ms
(experiments/notes/step.md): about 0.5 ms per step in which the GPU waits for the engine. This
splits that time. One engine as the sweep builds it (UniformDrafter, CUDA graphs where the target
allows them), one request with a `--context`-token prompt, then phases of `--steps` steps: plain
decoding (k = 0) and forced acceptance length `--al` at k = `--k` (synthetic acceptance). Per
phase, medians over its steps:

- step_us: wall time of Engine.step; graph_gpu_us: the replay's device time between CUDA events
  recorded around it; idle_us = step_us - graph_gpu_us, the device waiting on the host;
- before_replay_us: from the step's start to the replay call (admission, draft, noise and the
  graph's input fill, of which fill_us is GraphedStep._fill); replay_call_us: the replay call
  itself (the graph launch); readback_us: from its return to the host lists (the readback's copy,
  the wait for the device, the lists); after_us: emitting, stop checks, metrics and the drafter's
  commit;
- python_top: the functions with the most own time per step from cProfile, in a separate pass
  whose overhead inflates every figure: read it for the ranking.

Without graphs (a CPU target, or --no-graphs) the replay parts are absent and the step runs
eagerly.

    python experiments/engine_host_profile.py --target k3-slice --context 2048 --steps 40 --out FILE
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import statistics
import sys
import time

import torch

from dspark.build import build_target, eos_ids
from dspark.config import SamplingParams, SpecConfig
from dspark.cuda_graphs import StepGraph
from dspark.drafters.uniform import UniformDrafter
from dspark.engine import Engine
from dspark.files import write_atomic
from dspark.graph_step import GraphedStep
from dspark.provenance import provenance


class StepClock:
    """Host timestamps of the parts of each step, and CUDA events around each replay, gathered
    by wrapping the engine's step, GraphedStep.run/_fill and StepGraph.replay."""

    def __init__(self):
        self.steps: list[dict] = []
        self.current: dict | None = None

    def mark(self, name: str) -> None:
        if self.current is not None:
            self.current[name] = time.perf_counter()

    @contextlib.contextmanager
    def installed(self, engine: Engine):
        clock = self
        step, run, fill, replay = engine.step, GraphedStep.run, GraphedStep._fill, StepGraph.replay

        def timed_step():
            clock.current = {"start": time.perf_counter()}
            try:
                return step()
            finally:
                clock.current["end"] = time.perf_counter()
                clock.steps.append(clock.current)
                clock.current = None

        def timed_run(graphs, *args, **kwargs):
            result = run(graphs, *args, **kwargs)
            clock.mark("run_end")
            return result

        def timed_fill(graphs, *args, **kwargs):
            clock.mark("fill_start")
            fill(graphs, *args, **kwargs)
            clock.mark("fill_end")

        def timed_replay(graph):
            clock.mark("replay_start")
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = replay(graph)
            end.record()
            clock.mark("replay_end")
            if clock.current is not None:
                clock.current["events"] = (begin, end)
            return out

        engine.step = timed_step
        GraphedStep.run, GraphedStep._fill, StepGraph.replay = timed_run, timed_fill, timed_replay
        try:
            yield self
        finally:
            del engine.step
            GraphedStep.run, GraphedStep._fill, StepGraph.replay = run, fill, replay

    def summary(self) -> dict:
        def median(parts):
            values = [parts(s) for s in self.steps]
            values = [v for v in values if v is not None]
            return 1e6 * statistics.median(values) if values else None

        def span(a, b):
            return lambda s: s[b] - s[a] if a in s and b in s else None

        out = {"steps": len(self.steps), "step_us": median(span("start", "end")),
               "before_replay_us": median(span("start", "replay_start")),
               "fill_us": median(span("fill_start", "fill_end")),
               "replay_call_us": median(span("replay_start", "replay_end")),
               "readback_us": median(span("replay_end", "run_end")),
               "after_us": median(span("run_end", "end"))}
        gpu = [s["events"][0].elapsed_time(s["events"][1]) * 1e3 for s in self.steps if "events" in s]
        if gpu:
            out["graph_gpu_us"] = statistics.median(gpu)
            out["idle_us"] = out["step_us"] - out["graph_gpu_us"]
        return out


def python_top(engine: Engine, steps: int, top: int) -> list[dict]:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{filename.rsplit('/', 1)[-1]}:{line}({name})",
                     "calls_per_step": calls / steps, "own_us": 1e6 * own / steps, "cumulative_us": 1e6 * cumulative / steps})
    return sorted(rows, key=lambda r: -r["own_us"])[:top]


def run(args) -> dict:
    k = args.k
    # Each phase runs warm-up, timed and profiled steps; plain ones take 1 position, the others at most k + 1.
    per_phase = args.warmup + 2 * args.steps
    target = build_target(args.target, max_slots=1, device=args.device,
                          max_seq_len=args.context + 1 + per_phase * (k + 2) + k + 2)
    spec = SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                      synthetic_acceptance_length=float(k + 1), seed=0)
    engine = Engine(target, UniformDrafter(target.vocab_size), spec, eos_token_ids=eos_ids(target),
                    cuda_graphs=False if args.no_graphs else None)
    prompt = torch.randint(0, target.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    engine.add_request(prompt.tolist(), SamplingParams(temperature=0.0, ignore_eos=True,
                                                       max_tokens=target.max_seq_len - args.context - 1))
    engine.step()  # prefill and the first step
    result = {**provenance(args.device, graphs=engine._graphs is not None), "target": args.target,
              "context": args.context, "k": k, "al": args.al, "phases": []}
    phases = [("plain", SpecConfig(num_speculative_tokens=0, seed=0)),
              (f"al{args.al:g}", SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                                            synthetic_acceptance_length=args.al, seed=0))]
    for name, phase_spec in phases:
        engine.set_acceptance(phase_spec)
        for _ in range(args.warmup):
            engine.step()
        with StepClock().installed(engine) as clock:
            for _ in range(args.steps):
                engine.step()
        row = {"phase": name, **clock.summary(), "python_top": python_top(engine, args.steps, args.top)}
        result["phases"].append(row)
        write_atomic(args.out, json.dumps(result, indent=1))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="k3-slice")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--al", type=float, default=6.0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-graphs", action="store_true", help="eager steps even where graphs are possible")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for name in ("context", "k", "steps", "top"):
        if getattr(args, name) < 1:
            print(f"engine_host_profile: --{name}={getattr(args, name)}: must be at least 1", file=sys.stderr)
            return 2
    if not 1.0 <= args.al <= args.k + 1:
        print(f"engine_host_profile: --al={args.al}: must lie in [1, k + 1 = {args.k + 1}]", file=sys.stderr)
        return 2
    result = run(args)
    print(f"{'phase':>6} {'step':>8} {'gpu':>8} {'idle':>7} {'before':>7} {'fill':>6} {'launch':>7} {'readback':>8} {'after':>6}  (us)")
    for r in result["phases"]:
        cells = [r.get(c) for c in ("step_us", "graph_gpu_us", "idle_us", "before_replay_us", "fill_us",
                                    "replay_call_us", "readback_us", "after_us")]
        print(f"{r['phase']:>6} " + " ".join(f"{c:8.1f}" if c is not None else f"{'-':>8}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
