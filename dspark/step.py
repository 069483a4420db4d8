"""One device step, run two ways (docs/architecture.md §6).

`DeviceStep.run` is the device part of an engine step: each slot's anchor read on the device,
verify of [anchor, drafts], acceptance (rejection sampling, or synthetic), the target's commit of
the kept tokens, the next anchors written back, and the drafter's commit for a drafter that commits
on the device. It reads static input tensors and returns its outputs as tensors, with no host
read, so it can be captured. Two runners call it:

- `EagerRunner` (here) runs it and reads its results back at once, in one copy;
- `dspark.graph_step.GraphedRunner` captures it once per (batch bucket, T, sampling flavour) and
  replays it, reading the results back after the replay (possibly after launching the next step).

The engine holds one runner and never asks which: both take a `StepBatch` and return a pending
step whose `result()` is a `StepResult`. Like gpt-fast and vLLM, the graphs wrap the same step;
they never fork it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .kernels import ops
from .protocols import Drafter
from .sampling import SamplingTensors, nonfinite_rows
from .transfer import LongStaging, long_tensor_on

# The tensors full_draft_counts made, and their ids: the dict keeps each alive, so an id is never
# reused by another tensor.
_full_counts: dict[tuple[int, int, torch.device], torch.Tensor] = {}
_full_count_ids: set[int] = set()


def full_draft_counts(batch: int, k: int, device) -> torch.Tensor:
    """num_drafts for a step where every request drafts k (a Proposal whose num_drafts is None):
    a [batch] long tensor of k, made once per (batch, k, device) and never written, so that no
    step launches a fill for it and a graphed step copies it in only when it changes."""
    key = (batch, k, torch.device(device))
    counts = _full_counts.get(key)
    if counts is None:
        counts = _full_counts[key] = torch.full((batch,), k, dtype=torch.long, device=device)
        _full_count_ids.add(id(counts))
    return counts


def is_full_draft_counts(counts: torch.Tensor) -> bool:
    """Whether `counts` is one of full_draft_counts' tensors (never written, so a copy of it stays
    valid)."""
    return id(counts) in _full_count_ids


class StepBatch(NamedTuple):
    """What the engine hands a runner for one step of B requests drafting up to k tokens."""

    slots: list[int]
    free_slots: list[int]  # slots no request holds (a graphed step's padding rows take them)
    drafts: torch.Tensor  # [B, k]
    num_drafts: torch.Tensor  # [B]
    probs: torch.Tensor | None  # [B, k, V] or None (one-hot proposals)
    sampling: SamplingTensors
    uniforms: torch.Tensor | None  # [B, >= k]; None: the acceptance reads none (all greedy, standard)
    noise: torch.Tensor | None  # [B, V] race noise; None: every row is greedy
    cond_rates: torch.Tensor | None  # [k] synthetic acceptance rates; None: rejection sampling
    draft_pools: tuple | None = None  # the DrawPools whose latest draws the drafts' rows are
    uniform_pools: tuple | None = None  # likewise for the uniforms' rows


class StepInputs(NamedTuple):
    """DeviceStep.run's inputs: device tensors over B rows (a graph's static buffers)."""

    slots: list[int] | torch.Tensor  # as the target takes them: host ints, or the device index
    index: torch.Tensor  # [B] the slots on the device
    valid: torch.Tensor | None  # [B] 1 for a request's row, 0 for a padding row; None: all requests
    live: torch.Tensor | None  # valid, and 0 while a graph warms up or is captured: rows whose
    # commits count; None: every row's
    drafts: torch.Tensor  # [B, T - 1]
    num_drafts: torch.Tensor  # [B]
    probs: torch.Tensor | None
    sampling: SamplingTensors
    uniforms: torch.Tensor  # [B, T - 1]
    noise: torch.Tensor  # [B, V]
    cond_rates: torch.Tensor | None


class StepOutputs(NamedTuple):
    """DeviceStep.run's outputs (a graph's static outputs, rewritten by every replay)."""

    packed: torch.Tensor  # [B, 4 + T - 1]: PACKED columns, then the drafts: the one readback
    num_accepted: torch.Tensor  # [B]
    tokens: torch.Tensor  # [B, T] anchor and drafts as verified
    taps: dict[int, torch.Tensor]  # {layer: [B, T, d]}


PACKED = ("num_accepted", "next_token", "num_drafts", "nonfinite")


@dataclass
class StepResult:
    """The host's view of one step (lists over the requests' rows) and device views that a host
    commit reads (a graph's static buffers: valid until its next replay; read-only)."""

    num_accepted: list[int]
    next_token: list[int]
    num_drafts: list[int]
    nonfinite: list[bool]  # a NaN or infinite logit among the row's verified positions
    drafts: list[list[int]]
    num_accepted_device: torch.Tensor  # [B]
    tokens_device: torch.Tensor  # [B, T]
    taps: dict[int, torch.Tensor]  # {layer: [B, T, d]}

    @classmethod
    def from_rows(cls, rows: list[list[int]], num_accepted: torch.Tensor, tokens: torch.Tensor,
                  taps: dict[int, torch.Tensor]) -> "StepResult":
        """From the packed rows read back (StepOutputs.packed, B rows) and the device views."""
        return cls(num_accepted=[r[0] for r in rows], next_token=[r[1] for r in rows],
                   num_drafts=[r[2] for r in rows], nonfinite=[bool(r[3]) for r in rows],
                   drafts=[r[4:] for r in rows], num_accepted_device=num_accepted, tokens_device=tokens, taps=taps)


class DeviceStep:
    """The device part of one engine step over a target, and each slot's anchor on the device (the
    token its next step verifies first: written where a request's first token is sampled, read and
    advanced by every step). drafter: committed inside the step when it commits on the device.
    sampler: a substitute for ops.rejection_sample (a test's deliberately broken one; eager only)."""

    def __init__(self, target, tap_layers: tuple[int, ...], drafter: Drafter | None = None,
                 sampler: Callable | None = None):
        self.target = target
        self.device = torch.device(target.device)
        self.tap_layers = tuple(tap_layers)
        self.drafter = drafter if drafter is not None and drafter.commits_on_device else None
        self.sampler = sampler
        self.anchors = torch.zeros(target.max_slots, dtype=torch.long, device=self.device)

    def run(self, x: StepInputs, on_verified: Callable[[], None] | None = None) -> StepOutputs:
        """One step on the device; no host read. on_verified: called once verify is queued (the
        eager runner's timing mark; a capture passes none)."""
        anchors = self.anchors.index_select(0, x.index)
        num_drafts = x.num_drafts if x.valid is None else x.num_drafts * x.valid
        lengths = 1 + num_drafts if x.valid is None else (1 + num_drafts) * x.valid  # padding verifies 0
        tokens = torch.cat([anchors[:, None], x.drafts], dim=1)
        out = self.target.verify(x.slots, tokens, lengths, self.tap_layers)
        if on_verified is not None:
            on_verified()
        if x.cond_rates is not None:
            num_accepted, next_token = ops.synthetic_sample(
                out.logits, x.drafts, num_drafts, x.cond_rates, x.sampling, x.uniforms, x.noise)
        else:
            sample = self.sampler or ops.rejection_sample  # on the GPU: kernels/acceptance
            num_accepted, next_token = sample(out.logits, x.drafts, num_drafts, x.probs, x.sampling, x.uniforms, x.noise)
        kept = num_accepted + 1 if x.live is None else (num_accepted + 1) * x.live
        self.target.commit(x.slots, kept)
        self.anchors.index_copy_(0, x.index, next_token if x.live is None else torch.where(x.live.bool(), next_token, anchors))
        if self.drafter is not None:
            self.drafter.commit_on_device(x.index, tokens, kept, out.taps)
        nonfinite = nonfinite_rows(out.logits, lengths).long()
        packed = torch.cat([num_accepted[:, None], next_token[:, None], num_drafts[:, None], nonfinite[:, None],
                            x.drafts], dim=1)
        return StepOutputs(packed, num_accepted, tokens, out.taps)


class _SlotIndex:
    """A batch's slots on the device, uploaded only when they differ from the last call's (nothing
    writes the tensor: it is an index)."""

    def __init__(self, max_slots: int, device: torch.device):
        self._staging = LongStaging(max_slots, device)
        self._last: tuple[tuple[int, ...], torch.Tensor] | None = None

    def __call__(self, slots: list[int]) -> torch.Tensor:
        key = tuple(slots)
        if self._last is None or self._last[0] != key:
            self._last = (key, self._staging.upload(slots))
        return self._last[1]


class StepRunner:
    """What the engine holds: runs a DeviceStep for a StepBatch (`launch`, returning a pending step
    whose `result()` is the StepResult and whose `in_flight` says whether the step may still be on
    the device) and keeps its anchors. `mark(phase)` attributes the time since the last mark
    (SpecMetrics.phase_seconds)."""

    def __init__(self, step: DeviceStep, mark: Callable[[str], None]):
        self.step = step
        self.mark = mark
        self._slot_index = _SlotIndex(step.target.max_slots, step.device)

    def anchors_of(self, slots: list[int]) -> torch.Tensor:
        """[B] the slots' anchors, read on the device in stream order (so also after a step that
        was launched and not yet read back)."""
        return self.step.anchors.index_select(0, self._slot_index(slots))

    def set_anchors(self, slots: list[int], tokens: torch.Tensor) -> None:
        """Each slot's next anchor (tokens [B] on the device), for steps launched after this call."""
        self.step.anchors.index_copy_(0, long_tensor_on(slots, self.step.device), tokens)

    def set_tap_layers(self, tap_layers: tuple[int, ...]) -> None:
        """The target layers every later step's verify taps."""
        self.step.tap_layers = tuple(tap_layers)

    def prepare(self, k_for_batch: Callable[[int], int], *, synthetic: bool, uniform_width: int,
                drafter: Drafter | None) -> None:
        """Make ready ahead of the first step what a runner can (the graphed runner captures its
        common graphs); nothing to do for an eager one."""

    def launch(self, batch: StepBatch):
        raise NotImplementedError


class ReadStep:
    """An eager step's pending step: read back when it ran."""

    in_flight = False

    def __init__(self, result: StepResult):
        self._result = result

    def result(self) -> StepResult:
        return self._result


class EagerRunner(StepRunner):
    """Runs the device step as plain torch calls and reads its results back in one copy (the
    step's one synchronisation). Phases: "verify" up to the verify call, "accept" for the rest."""

    def __init__(self, step: DeviceStep, mark: Callable[[str], None]):
        super().__init__(step, mark)
        # What an all-greedy acceptance does not read, as views of one element (no allocation).
        self._no_uniforms = torch.zeros(1, 1, device=step.device)
        self._no_noise = torch.ones(1, 1, device=step.device)
        self._verified = functools.partial(mark, "verify")

    def launch(self, batch: StepBatch) -> ReadStep:
        B, k = len(batch.slots), batch.drafts.shape[1]
        uniforms = self._no_uniforms.expand(B, k) if batch.uniforms is None else batch.uniforms[:, :k]
        noise = self._no_noise.expand(B, self.step.target.vocab_size) if batch.noise is None else batch.noise
        x = StepInputs(batch.slots, self._slot_index(batch.slots), None, None, batch.drafts, batch.num_drafts,
                       batch.probs, batch.sampling, uniforms, noise, batch.cond_rates)
        out = self.step.run(x, self._verified)
        result = StepResult.from_rows(out.packed.tolist(), out.num_accepted, out.tokens, out.taps)
        self.mark("accept")
        return ReadStep(result)
