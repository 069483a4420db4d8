"""Host-side engine time per step: batch 1, k = 7, a target and a drafter that do no work.

What is left is the engine's own bookkeeping (proposal handling, noise, acceptance, stop checks,
commit, metrics), the cost every real step pays on top of the model. Goal: under 50 us per step.

    python experiments/engine_overhead.py [--steps 2000] [--k 7] [--vocab 32] [--out FILE]   # greedy and T = 1
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dspark.config import SamplingParams, SpecConfig
from dspark.engine import Engine
from dspark.protocols import Drafter, Proposal, TargetOutput
from dspark.provenance import provenance
from dspark.threads import one_cpu_thread


class NullTarget:
    """Returns the same logits every time; keeps no state."""

    num_layers, hidden_size, max_slots = 1, 8, 1
    device = torch.device("cpu")

    def __init__(self, vocab_size: int, k: int, max_seq_len: int):
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        logits = torch.randn(1, k + 1, vocab_size)
        logits[0, :, 3] += 100.0  # token 3 is always the argmax, so greedy accepts the drafts
        self.out = TargetOutput(logits, {})

    def prefill(self, slots, prompts, tap_layers=()):
        return self.out

    def verify(self, slots, tokens, lengths, tap_layers=()):
        return self.out

    def commit(self, slots, num_tokens):
        pass

    def release(self, slots):
        pass


class NullDrafter(Drafter):
    tap_layers = ()

    def __init__(self, k: int):
        self.proposal = Proposal(torch.full((1, k), 3), torch.full((1,), k))

    def start(self, slot, prompt, taps):
        pass

    def propose(self, slots, anchors, k, sampling, generators):
        return self.proposal

    def commit(self, slots, tokens, num_tokens, taps):
        pass

    def release(self, slots):
        pass


def measure(k: int, steps: int, temperature: float, vocab: int) -> list[float]:
    target = NullTarget(vocab, k, max_seq_len=10 * steps * (k + 1))
    engine = Engine(target, NullDrafter(k), SpecConfig(num_speculative_tokens=k), sync_timing=False)
    engine.add_request([1, 2, 3], SamplingParams(temperature=temperature, max_tokens=steps * (k + 1) + 1, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first call also runs prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    with one_cpu_thread():
        for temperature in (0.0, 1.0):
            measure(args.k, 200, temperature, args.vocab)  # warm-up
            t = measure(args.k, args.steps, temperature, args.vocab)
            rows.append({"temperature": temperature, "k": args.k, "batch": 1, "steps": len(t),
                         "us_per_step_median": 1e6 * statistics.median(t), "us_per_step_p90": 1e6 * sorted(t)[int(0.9 * len(t))]})
    for r in rows:
        print(f"temperature {r['temperature']:.1f}: {r['us_per_step_median']:.1f} us/step median, "
              f"{r['us_per_step_p90']:.1f} us p90 over {r['steps']} steps (batch 1, k={r['k']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": provenance("cpu", vocab=args.vocab), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
