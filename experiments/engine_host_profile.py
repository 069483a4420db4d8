"""Where a batch-1 engine step spends its time besides the GPU's work (issue 12).

One engine as the sweep builds it (UniformDrafter, CUDA graphs where the target allows them), one
request with a `--context`-token prompt, then phases of `--steps` steps: plain decoding (k = 0)
and forced acceptance length `--al` at k = `--k` (synthetic acceptance), each with steps launched
ahead (the engine's default: a step goes to the device before the one before it is read back)
and with every step read back before the next is launched. `--drafter dspark` drafts with a
DSpark drafter of random weights at the target's width instead (K3's preset for k3 and k3-slice),
its greedy drafts and commits as CUDA graphs on a CUDA target: the whole DSpark loop's host cost
at the forced acceptance length. Per phase, medians over its steps:

- step_us: wall time of Engine.step; graph_gpu_us: the engine step graph's device time between
  CUDA events recorded around its replay; drafter_gpu_us: likewise for the DSpark drafter's draft
  and commit graphs of the step (absent for other drafters); idle_us = step_us - both, the device
  waiting on the host;
- wait_us: time the host spent waiting for the device (CUDA event synchronisation), of which
  readback_wait_us inside the readback (the rest: a staging buffer waiting for its last copy);
  host_us = step_us - wait_us, the host's own work in the step (hidden behind the device's
  when the next step was launched ahead);
- launch_us: GraphedRunner.launch (the graph's input fill, of which fill_us is GraphedRunner._fill,
  the replay call, and the queued readback); replay_call_us: the replay call itself;
  readback_us: PendingStep.result, the wait for the device and the host lists;
- light: step_us, host_us, launch_us and readback_host_us (readback_us less readback_wait_us) of a second
  pass that times only the launch, the readback and the waits: the host's cost of "graph launch +
  the one readback" without the other wrappers' own cost in it;
- python_top: the functions with the most own time per step from cProfile, in a separate pass
  whose overhead inflates every figure: read it for the ranking.

Without graphs (a CPU target, or --no-graphs) the replay parts are absent and the step runs
eagerly (and is never launched ahead).

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

from dspark.build import build_target
from dspark.config import SamplingParams, SpecConfig
from dspark.cuda_graphs import StepGraph
from dspark.drafters.uniform import UniformDrafter
from dspark.engine import Engine
from dspark.files import write_atomic
from dspark.graph_step import GraphedRunner, PendingStep
from dspark.provenance import provenance
from dspark.targets import eos_ids


class StepClock:
    """Host timestamps of the parts of each step, and CUDA events around each replay, gathered
    by wrapping the engine's step, GraphedRunner.launch/_fill, StepGraph.replay, PendingStep.result
    and CUDA event synchronisation. A step's parts are those that happened during its call (with
    launch-ahead: the next step's launch and this step's readback)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.current: dict | None = None
        self._inside: list[str] = []  # the timed parts now running, outermost first

    def add(self, name: str, seconds: float) -> None:
        if self.current is not None:
            self.current[name] = self.current.get(name, 0.0) + seconds
            if name == "wait" and "readback" in self._inside:
                self.current["readback_wait"] = self.current.get("readback_wait", 0.0) + seconds

    def timed(self, name: str, fn):
        clock = self

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            clock._inside.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                clock._inside.pop()
                clock.add(name, time.perf_counter() - t0)
        return wrapper

    @contextlib.contextmanager
    def installed(self, engine: Engine, light: bool = False):
        """light: time only the launch, the readback and the waits (no CUDA events or wrappers
        inside the launch, whose own cost would count in it)."""
        clock = self
        step, replay = engine.step, StepGraph.replay
        patched = [(GraphedRunner, "launch", "launch"), (PendingStep, "result", "readback"),
                   (torch.cuda.Event, "synchronize", "wait")]
        if not light:
            patched.append((GraphedRunner, "_fill", "fill"))
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patched]

        def timed_step():
            clock.current = {"start": time.perf_counter()}
            try:
                return step()
            finally:
                clock.current["end"] = time.perf_counter()
                clock.steps.append(clock.current)
                clock.current = None

        def timed_replay(graph):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            t0 = time.perf_counter()
            out = replay(graph)
            clock.add("replay_call", time.perf_counter() - t0)
            end.record()
            if clock.current is not None:  # the engine's step graph, or one of the drafter's
                kind = "step" if graph.what.startswith("engine step") else "drafter"
                clock.current.setdefault("events", []).append((kind, begin, end))
            return out

        engine.step = timed_step
        if not light:
            StepGraph.replay = timed_replay
        for (owner, attr, name), (_, _, original) in zip(patched, saved):
            setattr(owner, attr, clock.timed(name, original))
        try:
            yield self
        finally:
            del engine.step
            StepGraph.replay = replay
            for owner, attr, original in saved:
                setattr(owner, attr, original)

    def summary(self) -> dict:
        def median(part):
            values = [part(s) for s in self.steps]
            values = [v for v in values if v is not None]
            return 1e6 * statistics.median(values) if values else None

        out = {"steps": len(self.steps), "step_us": median(lambda s: s["end"] - s["start"])}
        for name in ("wait", "readback_wait", "launch", "fill", "replay_call", "readback"):
            out[f"{name}_us"] = median(lambda s, name=name: s.get(name))
        out["host_us"] = median(lambda s: s["end"] - s["start"] - s.get("wait", 0.0))
        out["readback_host_us"] = median(
            lambda s: s["readback"] - s.get("readback_wait", 0.0) if "readback" in s else None)

        def device_us(step: dict, kinds: tuple[str, ...]) -> float:
            return sum(b.elapsed_time(e) * 1e3 for kind, b, e in step["events"] if kind in kinds)

        timed = [s for s in self.steps if "events" in s]
        if timed:
            out["graph_gpu_us"] = statistics.median(device_us(s, ("step",)) for s in timed)
            if any(kind == "drafter" for s in timed for kind, _, _ in s["events"]):
                out["drafter_gpu_us"] = statistics.median(device_us(s, ("drafter",)) for s in timed)
            out["idle_us"] = statistics.median(
                1e6 * (s["end"] - s["start"]) - device_us(s, ("step", "drafter")) for s in timed)
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


def make_drafter(name: str, target):
    """--drafter: the UniformDrafter (its drafts cost nothing), or a DSpark drafter with random
    weights at the preset of the target's width and vocabulary, tapping layers spread over the
    target's (never its last), sharing its embedding and lm_head."""
    if name == "uniform":
        return UniformDrafter(target.vocab_size)
    from dspark.drafters.dspark import DSparkDrafter, DSparkModel, shared_embeddings
    from dspark.drafters.dspark.config import preset_for_target

    try:
        config = preset_for_target(getattr(target, "hidden_size", None), target.vocab_size,
                                   getattr(target, "num_layers", 0))
    except ValueError as error:
        raise ValueError(f"--drafter=dspark: {error}") from None
    embed, lm_head = shared_embeddings(target)
    torch.manual_seed(0)
    model = DSparkModel(config, embed, lm_head).to(device=embed.device, dtype=embed.dtype)
    return DSparkDrafter(model, target.max_slots, max_seq_len=target.max_seq_len,
                         cuda_graphs=embed.device.type == "cuda")


def run(args) -> dict:
    k = args.k
    # Each phase runs warm-up, timed and profiled steps (and one drained step launched ahead);
    # plain ones take 1 position, the others at most k + 1; each phase runs with and without
    # launch-ahead.
    per_phase = 2 * (args.warmup + 3 * args.steps + 1)
    target = build_target(args.target, max_slots=1, device=args.device,
                          max_seq_len=args.context + 1 + per_phase * (k + 2) + k + 2)
    spec = SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                      synthetic_acceptance_length=float(k + 1), seed=0)
    engine = Engine(target, make_drafter(args.drafter, target), spec, eos_token_ids=eos_ids(target),
                    cuda_graphs=False if args.no_graphs else None)
    prompt = torch.randint(0, target.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    engine.add_request(prompt.tolist(), SamplingParams(temperature=0.0, ignore_eos=True,
                                                       max_tokens=target.max_seq_len - args.context - 1))
    engine.step()  # prefill and the first step
    result = {**provenance(args.device, graphs=isinstance(engine.runner, GraphedRunner)), "target": args.target,
              "drafter": args.drafter, "context": args.context, "k": k, "al": args.al, "phases": []}
    specs = [("plain", SpecConfig(num_speculative_tokens=0, seed=0)),
             (f"al{args.al:g}", SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                                           synthetic_acceptance_length=args.al, seed=0))]
    for ahead in ((True, False) if isinstance(engine.runner, GraphedRunner) else (False,)):
        for name, phase_spec in specs:
            engine.drain()  # a step launched ahead belongs to the phase before
            engine.set_acceptance(phase_spec)
            engine.launch_ahead = ahead
            for _ in range(args.warmup):
                engine.step()
            launched_ahead = engine.metrics.num_launched_ahead
            with StepClock().installed(engine) as clock:
                for _ in range(args.steps):
                    engine.step()
            engine.drain()  # the last step launched one ahead: its CUDA events must be done
            with StepClock().installed(engine, light=True) as light:
                for _ in range(args.steps):
                    engine.step()
            row = {"phase": name, "launch_ahead": ahead, **clock.summary(),
                   "steps_launched_ahead": engine.metrics.num_launched_ahead - launched_ahead,
                   "light": {k: light.summary()[k] for k in ("step_us", "host_us", "launch_us", "readback_host_us")},
                   "python_top": python_top(engine, args.steps, args.top)}
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
    p.add_argument("--drafter", choices=("uniform", "dspark"), default="uniform",
                   help="uniform: drafts that cost nothing; dspark: a random-weight DSpark drafter at the target's width")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for name in ("context", "k", "steps", "top"):
        if getattr(args, name) < 1:
            print(f"engine_host_profile: --{name}={getattr(args, name)}: must be at least 1", file=sys.stderr)
            return 2
    if not 1.0 <= args.al <= args.k + 1:
        print(f"engine_host_profile: --al={args.al}: must lie in [1, k + 1 = {args.k + 1}]", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except ValueError as error:
        print(f"engine_host_profile: {error}", file=sys.stderr)
        return 2
    columns = ("step_us", "graph_gpu_us", "drafter_gpu_us", "idle_us", "host_us", "wait_us", "readback_wait_us",
               "launch_us", "fill_us", "replay_call_us", "readback_us")
    widths = [max(8, len(c) - 3) for c in columns]
    print(f"{'phase':>6} {'ahead':>5} " + " ".join(f"{c[:-3]:>{w}}" for c, w in zip(columns, widths)) + "  (us)")
    for r in result["phases"]:
        cells = [r.get(c) for c in columns]
        print(f"{r['phase']:>6} {'yes' if r['launch_ahead'] else 'no':>5} "
              + " ".join(f"{c:{w}.1f}" if c is not None else f"{'-':>{w}}" for c, w in zip(cells, widths)))
    print("light pass (launch and readback only): " + "; ".join(
        f"{r['phase']}{'' if r['launch_ahead'] else ' read back first'}: launch {r['light']['launch_us'] or 0:.1f} us, "
        f"readback on the host {r['light']['readback_host_us'] or 0:.1f} us" for r in result["phases"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
