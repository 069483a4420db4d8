"""The graphed runner: the device step (dspark/step.py, DeviceStep.run) captured as CUDA graphs
and replayed (docs/architecture.md §6). Graph mechanics live here, and only here: the static
buffers, the pinned readback, the draws mirrored on the device.

One graph per (batch bucket, T, sampling flavour), captured the first time that shape is needed
and replayed every step after. Inputs go into static buffers: the slots and row flags into a
pinned buffer that the graph's first node copies to the device, the drafts by device-to-device
copies before the replay (or, for draws of a DrawPool, read on the device from a DrawMirror).
Each slot's anchor lives on the device (DeviceStep.anchors), so a step can be launched before the
previous one is read back (`launch` returns a PendingStep). The accepted counts, next tokens and
drafts come back in one asynchronous copy into pinned memory after the replay, the one host read
of the step.

Capture is side-effect free, so it can happen mid-run on live slots: the commits and the anchor
write inside the step are gated by `enabled`, which is 0 while warming up and capturing (a verify
is output-only; the MLA rows it writes lie past the committed length). Padding rows of a bucket
(batch 3 runs in the bucket of 4) take free slots, verify 0 tokens, commit 0 and keep their
anchors: they change nothing. A batch past the largest bucket runs eagerly (EagerRunner).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, NamedTuple

import numpy as np
import torch

from .cuda_graphs import BUCKETS, StepGraph, bucket_table, current_stream
from .protocols import Drafter
from .sampling import DrawPool, SamplingTensors
from .step import DeviceStep, EagerRunner, StepBatch, StepInputs, StepOutputs, StepResult, StepRunner, is_full_draft_counts


def capturable(target) -> bool:
    """Whether a target's verify and commit can be captured: a CUDA target that declares
    `supports_cuda_graphs` (they read no device value on the host and take a device slot index)."""
    return torch.device(target.device).type == "cuda" and bool(getattr(target, "supports_cuda_graphs", False))


class DrawMirror:
    """Each slot's current DrawPool block kept on the device beside the index of the row its next
    step reads: a graph takes one row per slot and advances the index itself, so the host copies a
    block once per `steps` steps instead of copying every step's rows into the graph's inputs (a
    copy call per input and step, a large part of a graphed step's host time). The rows taken are
    the pools' own, value for value.

    `prepare` (host, before each launch) says which pool each real row reads; `take` (device,
    captured) reads the rows and advances the live ones. Between them the host keeps what the
    device will hold after the launches already queued, and enqueues a block copy or an index
    write only where a pool moved on without it: a refill, a new request in the slot, or a step
    that read the pool's rows eagerly."""

    def __init__(self, slots: int, steps: int, width: int, dtype: torch.dtype, device):
        # One spare row past the last: a padding row's slot may hold an index of `steps` (its last
        # request took every row), and what a padding row reads is never used.
        self.steps = steps
        self.blocks = torch.zeros(slots, steps + 1, width, dtype=dtype, device=device)
        self.next_row = torch.zeros(slots, dtype=torch.long, device=device)
        self._expected: dict[int, tuple[torch.Tensor, int]] = {}  # slot -> (block, index) once queued work ran

    def prepare(self, slots: list[int], pools) -> None:
        """Row b of the next launch is pools[b]'s latest draw (each pool of this mirror's shape)."""
        for slot, pool in zip(slots, pools):
            block, row = pool.block, pool.latest_row
            expected = self._expected.get(slot)
            if expected is None or expected[0] is not block:
                self.blocks[slot, : self.steps].copy_(block)
                self.next_row[slot].fill_(row)
            elif expected[1] != row:
                self.next_row[slot].fill_(row)
            self._expected[slot] = (block, row + 1)

    def take(self, slots: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """[B, width]: row next_row[slot] of each slot's block; the index of each row with live = 1
        advances (live = 0: padding rows, warm-up and capture). Device work only."""
        rows = self.blocks[slots, self.next_row.index_select(0, slots)]
        self.next_row.index_add_(0, slots, live)
        return rows


def mirrored_shape(pools, tokens: int) -> tuple[int, int] | None:
    """The (steps, width) of a DrawMirror that can stand for these pools' rows in a step of T =
    tokens (None: the rows are copied in: no pools, no drafts, pools of two shapes or too narrow)."""
    if pools is None or tokens == 1:
        return None
    shape = (pools[0].steps, pools[0].width)  # a mirror holds one shape
    if any((p.steps, p.width) != shape for p in pools):
        return None
    return shape if shape[1] >= tokens - 1 else None


class GraphKey(NamedTuple):
    # A tuple, not a frozen dataclass: launch builds and hashes one per step, which for a frozen
    # dataclass costs several object.__setattr__ calls and the hash of a new tuple.
    batch: int  # the bucket
    tokens: int  # T = 1 + drafts verified
    all_greedy: bool  # SamplingTensors' host flags choose the acceptance kernels' variant
    filters: bool
    has_probs: bool  # dense draft probabilities (probabilistic drafting)
    synthetic: bool  # forced acceptance (synthetic_sample) instead of rejection sampling
    # (steps, width) of the DrawPools the drafts / uniforms are rows of, read on the device from a
    # DrawMirror; None: copied into the graph's input buffer before each replay.
    draft_pools: tuple[int, int] | None = None
    uniform_pools: tuple[int, int] | None = None


class _Inputs(NamedTuple):
    """A graph's input buffers over the first B rows (None: the graph has no such input)."""

    drafts: torch.Tensor
    num_drafts: torch.Tensor
    uniforms: torch.Tensor  # [B, T - 1]
    probs: torch.Tensor | None
    noise: torch.Tensor


class _Outputs(NamedTuple):
    """A captured graph's outputs over the first B rows, as StepResult hands them on."""

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    taps: dict[int, torch.Tensor]


class PendingStep:
    """A launched step whose results have not been read: `result()` waits for its readback."""

    in_flight = True

    def __init__(self, step: "_StaticStep", parity: int, batch: int, outputs: _Outputs):
        self._step, self._parity, self._batch, self._outputs = step, parity, batch, outputs

    def result(self) -> StepResult:
        step, out = self._step, self._outputs
        step.done[self._parity].synchronize()
        # Read through the NumPy view made with the buffer: a torch slice and .tolist() are two
        # host calls of their own, NumPy's much cheaper.
        rows = step.host_view[self._parity, : self._batch].tolist()
        step.owner.mark("verify")
        return StepResult.from_rows(rows, out.num_accepted, out.tokens, out.taps)


class _StaticStep:
    """The buffers of one graph, the step it runs on them (`__call__`, what is captured) and,
    once captured, the graph."""

    def __init__(self, owner: "GraphedRunner", key: GraphKey):
        target, dev, B, T = owner.step.target, owner.step.device, key.batch, key.tokens
        self.owner, self.key = owner, key
        self.host_rows = owner.host_rows(B)[0]  # pinned, filled before each replay; the graph copies it in
        self.rows = torch.zeros(2, B, dtype=torch.long, device=dev)  # slots, valid (1 = real row)
        self.drafts = torch.zeros(B, T - 1, dtype=torch.long, device=dev)
        self.num_drafts = torch.zeros(B, dtype=torch.long, device=dev)
        self.uniforms = torch.zeros(B, max(T - 1, 1), device=dev)
        self.noise = torch.ones(B, target.vocab_size, device=dev)
        self.probs = torch.ones(B, T - 1, target.vocab_size, device=dev) if key.has_probs else None
        self.cond_rates = torch.ones(max(T - 1, 1), device=dev) if key.synthetic else None
        self.rates_source = None
        self.counts_source = None  # the full_draft_counts tensor num_drafts holds a copy of, if any
        self.sampling = SamplingTensors(torch.zeros(B, device=dev), torch.zeros(B, dtype=torch.long, device=dev),
                                        torch.ones(B, device=dev), key.all_greedy, key.filters)
        self.sampling_source = None
        # Two readback buffers and events: a step launched before the previous one is read back
        # copies its results into the other (the host may not have read the first yet). Each
        # buffer's view and the NumPy view are made once: every torch call, a slice too, costs the
        # host time per step.
        host_out = torch.empty(2, B, T + 3, dtype=torch.long, pin_memory=True)
        self.host_out, self.host_view = tuple(host_out), host_out.numpy()
        self.done = (torch.cuda.Event(), torch.cuda.Event())
        self.launches = 0  # replays of this graph
        self.graph: StepGraph | None = None  # set once captured
        self._inputs: dict[int, _Inputs] = {}  # batch -> views, made on first use
        self._outputs: dict[int, _Outputs] = {}

    def inputs(self, B: int) -> _Inputs:
        """The input buffers' views over the first B rows, made once per B (a slice is a torch call)."""
        if B not in self._inputs:
            self._inputs[B] = _Inputs(self.drafts[:B], self.num_drafts[:B], self.uniforms[:B, : self.key.tokens - 1],
                                      self.probs[:B] if self.probs is not None else None, self.noise[:B])
        return self._inputs[B]

    def outputs(self, B: int) -> _Outputs:
        """The captured graph's outputs over the first B rows, made once per B (after the capture:
        the tensors the graph writes are those of its captured run)."""
        if B not in self._outputs:
            out: StepOutputs = self.graph.outputs
            self._outputs[B] = _Outputs(out.num_accepted[:B], out.tokens[:B], {layer: t[:B] for layer, t in out.taps.items()})
        return self._outputs[B]

    def __call__(self) -> StepOutputs:
        owner, key = self.owner, self.key
        # The rows' upload is a node of the graph, not a copy call of the host's per step. The
        # readback stays a call after the replay: whether torch captures a device-to-host copy
        # into pinned memory in its default capture mode is an open question upstream
        # (pytorch/pytorch#166765), where a host-to-device one from pinned memory is shown to
        # capture and replay.
        self.rows.copy_(self.host_rows, non_blocking=True)
        slots, valid = self.rows
        live = valid * owner.enabled
        if key.draft_pools is not None:
            self.drafts.copy_(owner.mirror("drafts", key.draft_pools).take(slots, live)[:, : key.tokens - 1])
        if key.uniform_pools is not None:
            uniforms = owner.mirror("uniforms", key.uniform_pools).take(slots, live)[:, : key.tokens - 1]
        else:
            uniforms = self.uniforms[:, : key.tokens - 1]
        return owner.step.run(StepInputs(slots, slots, valid, live, self.drafts, self.num_drafts, self.probs,
                                         self.sampling, uniforms, self.noise, self.cond_rates))


class GraphedRunner(StepRunner):
    """Graphs of one engine's device step, keyed by GraphKey; `launch` replays (capturing first when
    the key is new) and returns a PendingStep. Batches no bucket holds run on an EagerRunner of the
    same step."""

    def __init__(self, step: DeviceStep, mark: Callable[[str], None], buckets=BUCKETS):
        if step.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True: the target is on {step.device}; CUDA graphs need a CUDA target")
        super().__init__(step, mark)
        self.buckets, self._bucket_of = bucket_table(buckets, step.target.max_slots)
        self._eager = EagerRunner(step, mark)
        # The graphs replay on the current stream of the device they were captured on, where the
        # readback's event is recorded.
        self._device_index = step.device.index if step.device.index is not None else torch.cuda.current_device()
        self.enabled = torch.ones((), dtype=torch.long, device=step.device)
        self._steps: dict[GraphKey, _StaticStep] = {}
        self._pool = None
        self._host_rows: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # bucket -> pinned buffer, its NumPy view
        self._rows_written: dict[int, tuple] = {}  # bucket -> (slots, padding slots) its buffer holds
        self._mirrors: dict[tuple[str, tuple[int, int]], DrawMirror] = {}

    def mirror(self, kind: str, shape: tuple[int, int]) -> DrawMirror:
        """The device copy of the slots' DrawPools of this kind ("drafts": token ids, "uniforms")
        and (steps, width), shared by every graph that reads them."""
        found = self._mirrors.get((kind, shape))
        if found is None:
            dtype = torch.long if kind == "drafts" else torch.float32
            found = self._mirrors[(kind, shape)] = DrawMirror(self.step.target.max_slots, *shape, dtype, self.step.device)
        return found

    def host_rows(self, bucket: int) -> tuple[torch.Tensor, np.ndarray]:
        """The bucket's pinned [2, bucket] buffer of slots and row flags, and its NumPy view
        (one per bucket: the graphs of every T read it)."""
        if bucket not in self._host_rows:
            host = torch.zeros(2, bucket, dtype=torch.long, pin_memory=True)
            self._host_rows[bucket] = (host, host.numpy())
        return self._host_rows[bucket]

    @property
    def replays(self) -> Counter[GraphKey]:
        """Replays per graph (what the steps actually ran)."""
        return Counter({key: step.launches for key, step in self._steps.items() if step.launches})

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket that holds `batch` requests (None: no graph does; the step runs
        eagerly)."""
        return self._bucket_of.get(batch)

    def set_tap_layers(self, tap_layers: tuple[int, ...]) -> None:
        """The graphs captured so far verify the old taps: they are dropped (a step in flight keeps
        its own) and captured again when next needed."""
        super().set_tap_layers(tap_layers)
        self._steps.clear()

    def prepare(self, k_for_batch: Callable[[int], int], *, synthetic: bool, uniform_width: int,
                drafter: Drafter | None) -> None:
        """The common graphs ahead of the first step: every bucket at T = 1 and T = k + 1, with
        all-greedy sampling (other shapes and sampling flavours are captured when first needed;
        a capture changes no state)."""
        for batch in self.buckets:
            for tokens in sorted({1, k_for_batch(batch) + 1}):
                drafts = tokens > 1
                self.capture(batch, tokens, synthetic=synthetic and drafts,
                             draft_pools=drafter.draft_pool_shape(tokens - 1) if drafter is not None and drafts else None,
                             # synthetic acceptance reads each request's uniforms from its DrawPool
                             uniform_pools=(DrawPool.STEPS, uniform_width) if synthetic and drafts else None)

    def capture(self, batch: int, tokens: int, *, all_greedy: bool = True, filters: bool = False,
                has_probs: bool = False, synthetic: bool = False, draft_pools: tuple[int, int] | None = None,
                uniform_pools: tuple[int, int] | None = None) -> None:
        """Capture one graph ahead of use. The buffers start zeroed: every row verifies 0 tokens,
        so this touches no state."""
        key = GraphKey(batch, tokens, all_greedy, filters, has_probs, synthetic, draft_pools, uniform_pools)
        if self.bucket(batch) != batch:
            raise ValueError(f"capture of batch {batch}, T={tokens}: not a bucket of this target "
                             f"(buckets {self.buckets})")
        if key not in self._steps:
            self._steps[key] = self._capture(_StaticStep(self, key))

    def _capture(self, step: _StaticStep) -> _StaticStep:
        self.enabled.fill_(0)
        try:
            step.graph = StepGraph(step, f"engine step (batch bucket {step.key.batch}, T={step.key.tokens})",
                                   pool=self._pool)
        finally:
            self.enabled.fill_(1)
        self._pool = step.graph.pool
        return step

    def launch(self, batch: StepBatch):
        """Launch one step for requests in batch.slots (padding rows take batch.free_slots), each
        verifying its slot's anchor first, and queue its readback; nothing waits for the device.
        The draws' pools (batch.draft_pools / uniform_pools), when of one shape, are read on the
        device from a DrawMirror instead of having their rows copied in.

        At most two launches may be unread at a time (the readback buffers alternate), and a
        launch for another set of slots must come after every earlier one was read (the slots'
        pinned buffer is rewritten then, and the graph copies it in when it runs)."""
        B, T = len(batch.slots), batch.drafts.shape[1] + 1
        Bk = self.bucket(B)
        if Bk is None:
            return self._eager.launch(batch)
        if len(batch.free_slots) < Bk - B:
            raise ValueError(f"batch of {B} in bucket {Bk}: needs {Bk - B} free slots for padding, "
                             f"have {len(batch.free_slots)}")
        draft_shape = mirrored_shape(batch.draft_pools, T)
        uniform_shape = mirrored_shape(batch.uniform_pools, T) if batch.uniforms is not None else None
        key = GraphKey(Bk, T, bool(batch.sampling.all_greedy), bool(batch.sampling.filters), batch.probs is not None,
                       batch.cond_rates is not None, draft_shape, uniform_shape)
        if draft_shape is not None:
            self.mirror("drafts", draft_shape).prepare(batch.slots, batch.draft_pools)
        if uniform_shape is not None:
            self.mirror("uniforms", uniform_shape).prepare(batch.slots, batch.uniform_pools)
        step = self._steps.get(key)
        if step is None:
            step = _StaticStep(self, key)
            self._fill(step, batch)  # the capture's warm-up runs on this step's inputs (gated off)
            self._steps[key] = self._capture(step)
        self._fill(step, batch)
        packed = step.graph.replay().packed
        parity = step.launches % 2
        step.launches += 1
        step.host_out[parity].copy_(packed, non_blocking=True)
        step.done[parity].record(current_stream(self._device_index))
        return PendingStep(step, parity, B, step.outputs(B))

    def _fill(self, step: _StaticStep, batch: StepBatch) -> None:
        slots, free_slots = batch.slots, batch.free_slots
        B, Bk, T = len(slots), step.key.batch, step.key.tokens
        # Written through a NumPy view of the pinned buffer, made once: one torch indexing op costs
        # the host more than the NumPy writes. Written only when the batch changed: a step launched
        # before the previous one ran finds it as it was, while that one's graph may still be about
        # to copy it in; when the batch changes every earlier launch was read back (launch's contract).
        rows_now = (tuple(slots), tuple(free_slots[: Bk - B]))
        if self._rows_written.get(Bk) != rows_now:
            rows = self.host_rows(Bk)[1]
            rows[0, :B] = slots
            rows[0, B:] = rows_now[1]
            rows[1, :B], rows[1, B:] = 1, 0
            self._rows_written[Bk] = rows_now
        views = step.inputs(B)
        if T > 1:  # at T = 1 there are no drafts, and num_drafts stays the zeros it was made as
            if step.key.draft_pools is None:
                views.drafts.copy_(batch.drafts)
            # Every row drafting k is one immutable tensor per batch size (full_draft_counts): a copy
            # of it stays valid, so it is copied only when another tensor comes.
            if batch.num_drafts is not step.counts_source:
                views.num_drafts.copy_(batch.num_drafts)
                step.counts_source = batch.num_drafts if is_full_draft_counts(batch.num_drafts) else None
        sampling = batch.sampling
        if step.sampling_source is not sampling:  # parameters change only when the batch does
            for name in ("temperature", "top_k", "top_p"):
                getattr(step.sampling, name)[:B].copy_(getattr(sampling, name))
            step.sampling_source = sampling
        if batch.probs is not None:
            views.probs.copy_(batch.probs)
        if batch.uniforms is not None and T > 1 and step.key.uniform_pools is None:  # T - 1 wide: no slice then
            uniforms = batch.uniforms
            views.uniforms.copy_(uniforms if uniforms.shape[1] == T - 1 else uniforms[:, : T - 1])
        if batch.noise is not None:
            views.noise.copy_(batch.noise)
        # The same tensor holds the same rates: the engine makes each k's once and never writes them.
        if batch.cond_rates is not None and step.rates_source is not batch.cond_rates:
            step.cond_rates[: batch.cond_rates.shape[0]].copy_(batch.cond_rates)
            step.rates_source = batch.cond_rates
