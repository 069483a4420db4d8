"""The step loop (docs/architecture.md §5): admit, draft, launch the device step on the engine's
runner, read it back, emit, stop, commit the drafter, release. One completion path and one commit
path whichever runner runs the device step (dspark/step.py); a step may be launched before the one
before it is read back where nothing it needs comes from that one's host results."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .drafting import Drafting
from .kernels import ops
from .metrics import SpecMetrics
from .protocols import Drafter, Proposal
from .requests import Request, Requests, StepOutput
from .sampling import SamplingTensors, nonfinite_rows
from .step import StepBatch, StepRunner


@dataclass
class StepRecord:
    """What one engine step did, handed to observers. Row i of every field is request
    request_ids[i] (the requests that were running at the step).

    proposal:     the drafts as verified: tokens [B, k] (columns >= num_drafts[i] are padding),
                  num_drafts [B] = drafts verified after the per-request cap and the verification
                  policy, probs [B, k, V] or None, confidence (calibrated) and confidence_logits
                  (raw) [B, k] when the drafter reports them.
    num_accepted: drafts accepted per request.
    emitted:      tokens appended to each request's output (accepted drafts, then the target's
                  token; cut at a stop condition or max_tokens).
    taps:         {layer: [B, 1 + k, d]} the target's hidden states over [anchor, drafts] for the
                  layers observers asked for in add_observer (empty when none asked).

    Records cover verify steps only: a request's first token, sampled from its prefill, is in its
    RequestOutput but in no record.
    """

    request_ids: list[int]
    proposal: Proposal
    num_accepted: list[int]
    emitted: list[list[int]]
    taps: dict[int, torch.Tensor]


StepObserver = Callable[[StepRecord], None]


def check_finite(reqs: list[Request], nonfinite: list[bool]) -> None:
    """The NaN guard: tokens drawn from NaN or infinite logits are garbage (argmax of NaN is
    token 0), so the step stops with the requests named instead of emitting them. nonfinite
    comes from dspark.sampling.nonfinite_rows, read with the step's other results (no extra
    synchronisation)."""
    if any(nonfinite):
        ids = [r.out.request_id for r, b in zip(reqs, nonfinite) if b]
        raise FloatingPointError(f"request(s) {ids}: the target returned non-finite logits; refusing to sample from them")


@dataclass
class _Launched:
    """A step on its way: what completing it needs (`pending.result()` reads it back)."""

    reqs: list[Request]
    slots: list[int]
    proposal: Proposal
    kmax: int
    t_start: float
    pending: object  # a runner's pending step: result(), in_flight


class StepLoop:
    """Runs an engine's steps: requests from `requests`, drafts from `drafting`, the device step on
    `runner`, counts in `metrics`. launch_ahead: see Engine."""

    def __init__(self, target, drafter: Drafter | None, requests: Requests, drafting: Drafting,
                 runner: StepRunner, launch_ahead: bool, sync_timing: bool):
        self.target, self.drafter = target, drafter
        self.device = torch.device(target.device)
        self.requests, self.drafting, self.runner = requests, drafting, runner
        self.tap_layers = tuple(drafter.tap_layers) if drafter is not None else ()
        self.launch_ahead, self.sync_timing = launch_ahead, sync_timing
        self.metrics = SpecMetrics()
        self.observers: list[StepObserver] = []
        self.observer_taps: tuple[int, ...] = ()
        self._inflight: _Launched | None = None  # a step launched before the previous one was read back
        self._last_mark = 0.0
        self._last_step_end = 0.0

    def step(self) -> list[StepOutput]:
        launched = self._take_inflight()
        events = []
        if launched is None:
            events = self._admit()
            if not self.requests.running:
                return events
            launched = self._launch(self.requests.running)
        # The next step goes to the device before this one is read back, where nothing it needs
        # comes from this step's host results (docs/architecture.md §6).
        if launched.pending.in_flight and self._may_launch_ahead(launched):
            self._inflight = self._launch(launched.reqs, ahead=True)
            self.metrics.num_launched_ahead += 1
        return events + self._complete(launched)

    def drain(self) -> list[StepOutput]:
        """Read back the step launched ahead, if any, and launch nothing after it."""
        launched = self._take_inflight()
        return self._complete(launched) if launched is not None else []

    def _take_inflight(self) -> _Launched | None:
        """The step launched ahead, taken; None when there is none, or when every row of it ended
        a step earlier (it is waited for, so that its buffers are free, and nothing is read)."""
        launched, self._inflight = self._inflight, None
        if launched is not None and all(r.out.finished for r in launched.reqs):
            launched.pending.result()
            return None
        return launched

    def _may_launch_ahead(self, launched: _Launched) -> bool:
        """Whether the step after `launched` may be launched before `launched` is read back: the
        same batch, with drafts, sampling and verify lengths that do not depend on what `launched`
        emits. Stop conditions are then seen one step late, so no request that `launched` may
        finish by max_tokens or by the context may be in it (an EOS only wastes the next step's
        row, which is discarded)."""
        if not self.launch_ahead or self.observers or self.drafting.policy_for(len(launched.reqs)) is not None:
            return False
        drafter = self.drafter
        if drafter is not None and not (drafter.stateless or drafter.commits_on_device):
            return False
        if self.requests.waiting and self.requests.free_slots:
            return False  # admission first
        k_now, k_then = self.drafting.step_k(len(launched.reqs)), launched.kmax
        max_spec = self.drafting.spec.max_speculative_seq_len
        for r in launched.reqs:
            most_after = r.num_computed + k_then + 1  # committed tokens once `launched` is read
            if r.out.finished or len(r.out.token_ids) + k_then + 1 >= r.params.max_tokens:
                return False
            if most_after + k_now + 1 > self.target.max_seq_len:
                return False
            if max_spec is not None and r.num_computed + 1 <= max_spec < most_after + 1:
                return False  # the draft gate may close during `launched`
        return True

    def _launch(self, reqs: list[Request], ahead: bool = False) -> _Launched:
        """Draft and put one step for `reqs` on the runner. ahead: the step before is not read
        back yet (_may_launch_ahead); the anchors are read on the device either way."""
        t_start = time.perf_counter()
        if not ahead:
            self._last_mark = t_start
        drafting, slots = self.drafting, [r.slot for r in reqs]
        sampling = drafting.sampling_tensors(reqs)
        # 1-2. draft and decide how many drafts each request verifies
        k_req = self.requests.drafts_allowed(reqs, drafting.step_k(len(reqs)), drafting.spec.max_speculative_seq_len)
        kmax = max(k_req)
        reads_anchors = kmax > 0 and self.drafter.reads_anchors
        proposal, pools = drafting.propose(reqs, k_req, kmax, self.runner.anchors_of(slots) if reads_anchors else None)
        self.mark("draft")
        # 3-5 on the device: verify, accept, commit (the target's, and the drafter's when on the device)
        uniforms, noise = drafting.draws(reqs, sampling)
        if self.drafter is not None and self.drafter.commits_on_device:
            self.drafter.reserve(slots, kmax + 1)
        # The rates are kmax long, the same tensor every step, so a graph copies them in only
        # when they change. The draws' pools go with them: a graph reads their rows on the device.
        pending = self.runner.launch(StepBatch(
            slots, self.requests.free_slots, proposal.tokens, proposal.num_drafts, proposal.probs, sampling,
            uniforms, noise, drafting.cond_rates(kmax), pools,
            None if uniforms is None else tuple(r.uniforms for r in reqs)))
        return _Launched(reqs, slots, proposal, kmax, t_start, pending)

    def _complete(self, launched: _Launched) -> list[StepOutput]:
        """Read a launched step's results, emit its tokens, stop what stops and commit."""
        reqs = launched.reqs
        result = launched.pending.result()
        # Rows of requests that ended at the step before (this one was launched before that one
        # was read back) are not looked at: their slots were released after this step ran.
        live = [i for i, r in enumerate(reqs) if not r.out.finished]
        check_finite([reqs[i] for i in live], [result.nonfinite[i] for i in live])
        events, keep, finished = [], [], []
        for i in live:
            event = self.requests.record_step(reqs[i], result.num_accepted[i], result.drafts[i], result.next_token[i])
            events.append(event)
            (finished if event.finished else keep).append(i)
        emitted = [e.new_token_ids for e in events]
        self.metrics.num_output_tokens += sum(len(e) for e in emitted)
        self.metrics.observe([result.num_drafts[i] for i in live], [result.num_accepted[i] for i in live])
        self.metrics.num_steps += 1
        if self.observers:
            record = StepRecord([reqs[i].out.request_id for i in live], launched.proposal,
                                [result.num_accepted[i] for i in live], emitted,
                                {layer: result.taps[layer] for layer in self.observer_taps})
            for observer in self.observers:
                observer(record)
        if keep:
            self._commit_drafter(launched, result, keep)
        self._release([reqs[i] for i in finished])
        self.requests.running = [reqs[i] for i in keep]
        self.mark("commit")
        # A step's wall time runs from its launch, or from the previous step's end when it was
        # launched before that one ended (then the two overlap on the host, not on the device).
        now = time.perf_counter()
        self.metrics.step_seconds.append(now - max(launched.t_start, self._last_step_end))
        self._last_step_end = now
        self.metrics.step_tokens.append(sum(len(e) for e in emitted))
        return events

    def _commit_drafter(self, launched: _Launched, result, keep: list[int]) -> None:
        """The drafter's part of the commit, for the requests that go on (the target committed on
        the device, in the step). A drafter that commits on the device did so in the step too and
        gets the kept counts; a stateless one keeps nothing."""
        drafter = self.drafter
        if drafter is None or drafter.stateless:
            return
        keep_slots = [launched.slots[i] for i in keep]
        if drafter.commits_on_device:
            drafter.settle(keep_slots, [result.num_accepted[i] + 1 for i in keep], launched.kmax + 1)
            return
        kept, tokens = result.num_accepted_device + 1, result.tokens_device
        taps = {layer: result.taps[layer] for layer in self.tap_layers}
        if len(keep) < len(launched.reqs):
            idx = torch.tensor(keep, device=self.device)
            kept, tokens = kept.index_select(0, idx), tokens.index_select(0, idx)
            taps = {layer: t.index_select(0, idx) for layer, t in taps.items()}
        drafter.commit(keep_slots, tokens, kept, taps)

    def _admit(self) -> list[StepOutput]:
        """Prefill the requests admission takes and sample each one's first token (its first
        anchor, set on the device for the steps after)."""
        new = self.requests.admit()
        if not new:
            return []
        t0 = time.perf_counter()
        slots = [r.slot for r in new]
        out = self.target.prefill(slots, [r.prompt.to(self.device) for r in new], self.tap_layers)
        logits = out.logits  # [B, 1, V]: after each prompt's last token
        check_finite(new, nonfinite_rows(logits).tolist())
        sampling = SamplingTensors.from_params([r.params for r in new], self.device)
        _, noise = self.drafting.draws(new, sampling)
        if noise is None:  # every row greedy: the race noise is never read
            noise = torch.ones(len(new), self.target.vocab_size, device=self.device)
        none = torch.zeros(len(new), 0, dtype=torch.long, device=self.device)
        zero = torch.zeros(len(new), dtype=torch.long, device=self.device)
        _, first = ops.rejection_sample(logits, none, zero, None, sampling, none.float(), noise)
        self.runner.set_anchors(slots, first)
        events, finished = [], []
        for i, (r, tok) in enumerate(zip(new, first.tolist())):
            event = self.requests.start(r, tok)
            self.metrics.num_output_tokens += len(event.new_token_ids)
            events.append(event)
            if r.out.finished:
                finished.append(r)
                continue
            if self.drafter is not None:
                self.drafter.start(r.slot, r.prompt, {layer: t[i, : len(r.prompt)] for layer, t in out.taps.items()})
            self.requests.running.append(r)
        self._release(finished)
        self.metrics.phase_seconds.setdefault("prefill", 0.0)
        self.metrics.phase_seconds["prefill"] += time.perf_counter() - t0
        return events

    def _release(self, reqs: list[Request]) -> None:
        if not reqs:
            return
        slots = self.requests.free(reqs)
        self.target.release(slots)
        if self.drafter is not None:
            self.drafter.release(slots)

    def mark(self, phase: str) -> None:
        """Attribute the time since the previous mark to `phase` (synchronising the device first
        when sync_timing, so asynchronous GPU work lands in the phase that launched it)."""
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.metrics.phase_seconds[phase] += now - self._last_mark
        self._last_mark = now
