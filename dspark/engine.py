"""The draft-and-verify engine (docs/architecture.md §5), the public facade over three parts:

    requests (dspark/requests.py)   admission, slots, stop conditions, streaming
    step loop (dspark/loop.py)      drafter.propose -> policy.verify_lengths -> the device step ->
                                    emit, stop, drafter commit (drafting: dspark/drafting.py)
    step runner (dspark/step.py)    the device step: verify, accept, commits; eager or graphed

Plain decoding is the same loop with k = 0 (no drafts, one verified token per step), so the
baseline and the speculative path share every line that touches the model and a greedy
comparison between them is meaningful.

Token flow of one request: prefill(prompt) gives the first output token x0, which the target has
not yet seen (the "anchor"). Each step verifies [x0, d1..dl]; with a drafts accepted the step
emits d1..da plus one token from the target (the correction at the first rejection or the bonus
after the last draft), keeps a + 1 tokens (x0, d1..da) in the target's state, and the emitted
last token becomes the next anchor. A step emits a + 1 tokens: vLLM's acceptance length.

This is the one decoding loop: calibration and self-distillation (drafters/dspark) run on it and
read what each step did through observers (`add_observer`, `StepRecord`).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from .config import SamplingParams, SpecConfig
from .cuda_graphs import checked_buckets
from .drafting import Drafting
from .graph_step import GraphedRunner, capturable
from .kernels import registry
from .loop import StepLoop, StepObserver, StepRecord
from .metrics import SpecMetrics
from .protocols import Drafter, Target
from .requests import RequestOutput, Requests, StepOutput
from .step import DeviceStep, EagerRunner

__all__ = ["Engine", "RequestOutput", "StepOutput", "StepRecord", "StepObserver"]


class Engine:
    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        spec: SpecConfig | None = None,
        eos_token_ids: tuple[int, ...] = (),
        policy=None,
        sampler: Callable | None = None,
        sync_timing: bool | None = None,
        cuda_graphs: bool | None = None,
        launch_ahead: bool = True,
        graph_buckets: tuple[int, ...] | None = None,
    ):
        """cuda_graphs: replay each step of up to 8 requests (graph_buckets' largest) as a CUDA graph,
        each batch in the smallest bucket that holds it (default dspark.cuda_graphs.BUCKETS, 1/2/4/8;
        cuda_graphs.buckets_up_to(n) covers a run of n requests at once). None: wherever the
        target can be captured (a CUDA target with `supports_cuda_graphs`) unless
        SpecConfig.batch1_profile.cuda_graphs is False; True: required (an error otherwise); False:
        eager steps. A substituted `sampler` runs eagerly. sync_timing: synchronise
        the device between phases so that metrics.phase_seconds splits GPU time by phase (default:
        on for eager CUDA steps, off with graphs, whose only synchronisation is the readback).
        launch_ahead: with graphs, launch a step before the previous one is read back wherever
        nothing it needs comes from that one's host results, so the host's work on a step
        overlaps the device's on the next; False: every step is read back before the next is
        launched (the same tokens, as a comparison)."""
        spec = (spec or SpecConfig(num_speculative_tokens=0)).validate()
        if spec.max_k > 0 and drafter is None:
            raise ValueError(f"SpecConfig.num_speculative_tokens={spec.max_k}: speculation needs a drafter")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise ValueError(f"drafter={type(drafter).__name__}: must subclass dspark.protocols.Drafter")
        self.target, self.drafter = target, drafter
        self.device = torch.device(target.device)
        self.tap_layers = tuple(drafter.tap_layers) if drafter is not None else ()
        self.drafting = Drafting(target, drafter, spec, policy)
        profile = spec.batch1_profile
        if cuda_graphs and not capturable(target):
            raise ValueError(f"cuda_graphs=True: the target ({type(target).__name__} on {self.device}) cannot be "
                             "captured; CUDA graphs need a CUDA target with supports_cuda_graphs")
        if cuda_graphs is None:
            cuda_graphs = capturable(target) and (profile is None or profile.cuda_graphs)
        # The one choice of mode: the rest of the engine holds a runner and never asks which.
        # A substituted sampler (a test's broken one) runs eagerly: graphs capture the registry's.
        step = DeviceStep(target, self.tap_layers, drafter, sampler)
        graphed = cuda_graphs and sampler is None
        buckets = checked_buckets("graph_buckets", graph_buckets)
        runner = GraphedRunner(step, self._mark, buckets) if graphed else EagerRunner(step, self._mark)
        if sync_timing is None:
            sync_timing = self.device.type == "cuda" and not graphed
        self.requests = Requests(target, eos_token_ids)
        self.loop = StepLoop(target, drafter, self.requests, self.drafting, runner, launch_ahead, sync_timing)
        runner.prepare(self.drafting.step_k, synthetic=self.drafting.synthetic,
                       uniform_width=self.drafting.uniform_width, drafter=drafter)

    def _mark(self, phase: str) -> None:
        self.loop.mark(phase)

    @property
    def spec(self) -> SpecConfig:
        return self.drafting.spec

    @property
    def runner(self):
        """The step runner (dspark.step.EagerRunner or dspark.graph_step.GraphedRunner)."""
        return self.loop.runner

    @property
    def metrics(self) -> SpecMetrics:
        return self.loop.metrics

    @metrics.setter
    def metrics(self, metrics: SpecMetrics) -> None:  # a phased sweep starts each phase's counts afresh
        self.loop.metrics = metrics

    @property
    def launch_ahead(self) -> bool:
        return self.loop.launch_ahead

    @launch_ahead.setter
    def launch_ahead(self, value: bool) -> None:
        self.loop.launch_ahead = value

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.requests.eos_token_ids

    def set_acceptance(self, spec: SpecConfig) -> None:
        """Switch k and the acceptance mode between steps, keeping the live requests (a phased
        sweep measures every forced AL on one prefilled context). The drafter stays the same.
        A step already launched ahead keeps the settings it was launched with: drain() first to
        switch at a step boundary."""
        self.drafting.set_spec(spec.validate())

    def add_observer(self, observer: StepObserver, tap_layers: tuple[int, ...] = ()) -> None:
        """Call `observer(StepRecord)` after every step from now on. tap_layers: target layers
        whose hidden states over the verified tokens the record should carry (verify then
        computes them too). Without observers a step builds no record."""
        loop = self.loop
        loop.observers.append(observer)
        loop.observer_taps = tuple(sorted({*loop.observer_taps, *tap_layers}))
        loop.runner.set_tap_layers(tuple(sorted({*self.tap_layers, *loop.observer_taps})))

    def profile_sps(self):
        """Steps/s of target.verify against the tokens it feeds (dspark.drafting.Drafting.profile_sps)."""
        return self.drafting.profile_sps()

    def step_k(self, batch_size: int) -> int:
        """k for a step of this many requests (SpecConfig.k_for_batch)."""
        return self.drafting.step_k(batch_size)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt: list[int] | torch.Tensor, params: SamplingParams | None = None) -> int:
        """Queue a request; raises ValueError naming the bad field. Returns its id."""
        return self.requests.add(prompt, params, self.spec.seed)

    def has_unfinished(self) -> bool:
        return self.requests.has_unfinished()

    def generate(
        self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion. A request with bad input comes back with `error` set and
        finish_reason "error"; it does not stop the others."""
        outputs = dict(self.requests.submit(prompts, params, self.spec.seed))
        for _ in self.stream_steps():
            pass
        return [outputs[rid] for rid in sorted(outputs)]

    def stream(self, prompts: list, params=None) -> Iterator[StepOutput]:
        """Like generate, but yields each request's new tokens as steps produce them."""
        for rid, out in self.requests.submit(prompts, params, self.spec.seed):
            if out.error is not None:
                yield StepOutput(rid, [], True, "error")
        yield from self.stream_steps()

    def stream_steps(self) -> Iterator[StepOutput]:
        while self.has_unfinished():
            yield from self.step()

    # ---- steps ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One step of every running request (admitting waiting ones first when slots are free)."""
        kernels = self.drafting.batch1_kernels
        if kernels and self.requests.next_batch_size() == 1:
            # The latency path's own kernel choice, for this engine's step (prefill included) only:
            # registry.scoped sets a context-local table, so other engines and the process-wide
            # overrides keep theirs.
            with registry.scoped(kernels):
                return self.loop.step()
        return self.loop.step()

    def drain(self) -> list[StepOutput]:
        """Read back the step launched ahead, if any, and launch nothing after it: what it emits
        (the events the next step() would have returned first). After it, every step launched
        so far is counted in `metrics` and the next step starts from the host's state."""
        return self.loop.drain()
