"""The target's part of an engine step as CUDA graphs: verify + acceptance + commit, replayed.

One graph per (batch bucket, T, sampling flavour), captured the first time that shape is needed
and replayed every step after. Inputs go into static buffers: the slots and row flags into a
pinned buffer that the graph's first node copies to the device, the drafts by device-to-device
copies before the replay. Each slot's anchor (the token the next step verifies first) lives on
the device: the graph reads it and writes the next one, so a step can be launched before the
previous one is read back (`launch` returns a PendingStep; docs/architecture.md, "The step on
the GPU"). The accepted counts, next tokens and drafts come back in one asynchronous copy into
pinned memory after the replay, the one host read of the step.

Capture is side-effect free, so it can happen mid-run on live slots: the commit and the anchor
write inside the graph are gated by `enabled`, which is 0 while warming up and capturing (a
verify is output-only; the MLA rows it writes lie past the committed length). Padding rows of a
bucket (batch 3 runs in the bucket of 4) take free slots, verify 0 tokens, commit 0 and keep
their anchors: they change nothing.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .cuda_graphs import BUCKETS, StepGraph, bucket_table, current_stream
from .kernels import ops
from .protocols import is_full_draft_counts
from .sampling import DrawMirror, SamplingTensors, nonfinite_rows

@dataclass
class GraphStepResult:
    """The host's view of one replayed step (lists over the real rows) and device views that the
    drafter's commit reads (rows of the bucket's static buffers, valid until the next replay of
    the same graph is launched; the same view objects, and taps dict, in every result of a graph
    at a batch size: read-only)."""

    num_accepted: list[int]
    next_token: list[int]
    num_drafts: list[int]
    nonfinite: list[bool]  # a NaN or infinite logit among the row's verified positions
    drafts: list[list[int]]
    num_accepted_device: torch.Tensor  # [B]
    tokens_device: torch.Tensor  # [B, T]: anchor and drafts as verified
    taps: dict[int, torch.Tensor]  # {layer: [B, T, d]}


class PendingStep:
    """A launched step whose results have not been read: `result()` waits for its readback."""

    def __init__(self, step: "_StaticStep", parity: int, batch: int, outputs: "_Outputs"):
        self._step, self._parity, self._batch, self._outputs = step, parity, batch, outputs

    @property
    def device_outputs(self) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """(accepted counts [B], the verified tokens [B, T], taps {layer: [B, T, d]}) on the device,
        for work queued behind the step before its readback (valid until the graph's next replay)."""
        return self._outputs.num_accepted, self._outputs.tokens, self._outputs.taps

    def result(self) -> GraphStepResult:
        step, B, out = self._step, self._batch, self._outputs
        step.done[self._parity].synchronize()
        # Read through the NumPy view made with the buffer: a torch slice and .tolist() are two
        # calls of a few microseconds each (engine_host_profile_1c6ffd9.json), NumPy's well under one.
        rows = step.host_view[self._parity, :B].tolist()
        return GraphStepResult(
            num_accepted=[r[0] for r in rows], next_token=[r[1] for r in rows], num_drafts=[r[2] for r in rows],
            nonfinite=[bool(r[3]) for r in rows], drafts=[r[4:] for r in rows],
            num_accepted_device=out.num_accepted, tokens_device=out.tokens, taps=out.taps)


class _Inputs(NamedTuple):
    """A step's static input buffers over the first B rows (None: the graph has no such input)."""

    drafts: torch.Tensor
    num_drafts: torch.Tensor
    uniforms: torch.Tensor  # [B, T - 1]
    probs: torch.Tensor | None
    noise: torch.Tensor


class _Outputs(NamedTuple):
    """A step's outputs over the first B rows, as GraphStepResult hands them on."""

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    taps: dict[int, torch.Tensor]


class GraphKey(NamedTuple):
    # A tuple, not a frozen dataclass: launch builds and hashes one per step, which for a frozen
    # dataclass costs microseconds of Python (six object.__setattr__ and a hash of a new tuple).
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


class _StaticStep:
    """The buffers of one graph and the step it runs on them."""

    def __init__(self, owner: "GraphedStep", key: GraphKey):
        target, dev, B, T = owner.target, owner.target.device, key.batch, key.tokens
        V = target.vocab_size
        self.owner, self.key = owner, key
        self.host_rows = owner.host_rows(B)[0]  # pinned, filled before each replay; the graph copies it in
        self.rows = torch.zeros(2, B, dtype=torch.long, device=dev)  # slots, valid (1 = real row)
        self.drafts = torch.zeros(B, T - 1, dtype=torch.long, device=dev)
        self.num_drafts = torch.zeros(B, dtype=torch.long, device=dev)
        self.uniforms = torch.zeros(B, max(T - 1, 1), device=dev)
        self.noise = torch.ones(B, V, device=dev)
        self.probs = torch.ones(B, T - 1, V, device=dev) if key.has_probs else None
        self.cond_rates = torch.ones(max(T - 1, 1), device=dev) if key.synthetic else None
        self.rates_source = None
        self.counts_source = None  # the full_draft_counts tensor num_drafts holds a copy of, if any
        self.sampling = SamplingTensors(torch.zeros(B, device=dev), torch.zeros(B, dtype=torch.long, device=dev),
                                        torch.ones(B, device=dev), key.all_greedy, key.filters)
        self.sampling_source = None
        # Two readback buffers and events: a step launched before the previous one is read back
        # copies its results into the other (the host may not have read the first yet). Each
        # buffer's view and the NumPy view are made once: every torch call, a slice too, costs the
        # host microseconds per step (engine_host_profile_1c6ffd9.json).
        host_out = torch.empty(2, B, T + 3, dtype=torch.long, pin_memory=True)
        self.host_out, self.host_view = tuple(host_out), host_out.numpy()
        self.done = (torch.cuda.Event(), torch.cuda.Event())
        self.launches = 0  # replays of this graph
        self._inputs: dict[int, _Inputs] = {}  # batch -> views, made on first use
        self._outputs: dict[int, _Outputs] = {}

    def inputs(self, B: int) -> _Inputs:
        """The input buffers' views over the first B rows, made once per B."""
        if B not in self._inputs:
            self._inputs[B] = _Inputs(self.drafts[:B], self.num_drafts[:B], self.uniforms[:B, : self.key.tokens - 1],
                                      self.probs[:B] if self.probs is not None else None, self.noise[:B])
        return self._inputs[B]

    def outputs(self, graph: StepGraph, B: int) -> _Outputs:
        """The captured graph's outputs over the first B rows, made once per B (after the capture:
        the tensors the graph writes are those of its captured run)."""
        if B not in self._outputs:
            _, num_accepted, taps = graph.outputs
            self._outputs[B] = _Outputs(num_accepted[:B], self.tokens[:B], {layer: t[:B] for layer, t in taps.items()})
        return self._outputs[B]

    def __call__(self):
        owner, key = self.owner, self.key
        # The rows' upload is a node of the graph, not a copy call of the host's per step (~22 us of
        # host time on the H200 while the device waited: engine_host_profile_1c6ffd9.json). The readback
        # stays a call after the replay: whether torch captures a device-to-host copy into pinned
        # memory in its default capture mode is an open question upstream (pytorch/pytorch#166765),
        # where a host-to-device one from pinned memory is shown to capture and replay.
        self.rows.copy_(self.host_rows, non_blocking=True)
        slots, valid = self.rows
        live = valid * owner.enabled
        if key.draft_pools is not None:
            self.drafts.copy_(owner.mirror("drafts", key.draft_pools).take(slots, live)[:, : key.tokens - 1])
        anchors = owner.anchors.index_select(0, slots)
        num_drafts = self.num_drafts * valid
        self.tokens = torch.cat([anchors[:, None], self.drafts], dim=1)  # an output: the drafter commits it
        lengths = (1 + num_drafts) * valid
        out = owner.target.verify(slots, self.tokens, lengths, owner.tap_layers)
        if key.uniform_pools is not None:
            uniforms = owner.mirror("uniforms", key.uniform_pools).take(slots, live)[:, : key.tokens - 1]
        else:
            uniforms = self.uniforms[:, : key.tokens - 1]
        if key.synthetic:
            num_accepted, next_token = ops.synthetic_sample(
                out.logits, self.drafts, num_drafts, self.cond_rates, self.sampling, uniforms, self.noise)
        else:
            num_accepted, next_token = ops.rejection_sample(
                out.logits, self.drafts, num_drafts, self.probs, self.sampling, uniforms, self.noise)
        owner.target.commit(slots, (num_accepted + 1) * live)
        owner.anchors.index_copy_(0, slots, torch.where(live.bool(), next_token, anchors))
        nonfinite = nonfinite_rows(out.logits, lengths).long()
        packed = torch.cat([num_accepted[:, None], next_token[:, None], num_drafts[:, None], nonfinite[:, None],
                            self.drafts], dim=1)
        return packed, num_accepted, out.taps


def _mirrored_shape(pools, tokens: int) -> tuple[int, int] | None:
    """The (steps, width) of a DrawMirror that can stand for these pools' rows in a step of T =
    tokens (None: the rows are copied in: no pools, no drafts, pools of two shapes or too narrow)."""
    if pools is None or tokens == 1:
        return None
    shape = (pools[0].steps, pools[0].width)  # a mirror holds one shape
    if any((p.steps, p.width) != shape for p in pools):
        return None
    return shape if shape[1] >= tokens - 1 else None


class GraphedStep:
    """Graphs of one engine's target step, keyed by GraphKey; `run` replays (capturing first when
    the key is new) and returns the host's view of the step."""

    def __init__(self, target, tap_layers=(), buckets=BUCKETS):
        if target.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True: the target is on {target.device}; CUDA graphs need a CUDA target")
        for name in ("verify", "commit"):
            if not callable(getattr(target, name, None)):
                raise ValueError(f"cuda_graphs=True: the target has no {name}()")
        self.target = target
        self.tap_layers = tuple(tap_layers)
        self.buckets, self._bucket_of = bucket_table(buckets, target.max_slots)
        # The graphs replay on the current stream of the device they were captured on, where the
        # readback's event is recorded.
        self._device_index = target.device.index if target.device.index is not None else torch.cuda.current_device()
        self.enabled = torch.ones((), dtype=torch.long, device=target.device)
        self._steps: dict[GraphKey, tuple[StepGraph, _StaticStep]] = {}
        self._pool = None
        self._host_rows: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # bucket -> pinned buffer, its NumPy view
        self._rows_written: dict[int, tuple] = {}  # bucket -> (slots, padding slots) its buffer holds
        # Each slot's anchor: written by the engine where a request's first token is sampled (and by
        # an eager step), read and advanced by every replay.
        self.anchors = torch.zeros(target.max_slots, dtype=torch.long, device=target.device)
        self._mirrors: dict[tuple[str, tuple[int, int]], DrawMirror] = {}

    def mirror(self, kind: str, shape: tuple[int, int]) -> DrawMirror:
        """The device copy of the slots' DrawPools of this kind ("drafts": token ids, "uniforms")
        and (steps, width), shared by every graph that reads them."""
        found = self._mirrors.get((kind, shape))
        if found is None:
            dtype = torch.long if kind == "drafts" else torch.float32
            found = self._mirrors[(kind, shape)] = DrawMirror(self.target.max_slots, *shape, dtype, self.target.device)
        return found

    def host_rows(self, bucket: int) -> tuple[torch.Tensor, np.ndarray]:
        """The bucket's pinned [2, bucket] buffer of slots and row flags, and its NumPy view
        (one per bucket: the graphs of every T read it)."""
        if bucket not in self._host_rows:
            host = torch.zeros(2, bucket, dtype=torch.long, pin_memory=True)
            self._host_rows[bucket] = (host, host.numpy())
        return self._host_rows[bucket]

    def set_anchors(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The next anchor of each slot in `slots` (device tensors, [B]), stream-ordered: a step
        launched after this call verifies tokens[b] first in slot slots[b]."""
        self.anchors.index_copy_(0, slots, tokens)

    @property
    def replays(self) -> Counter[GraphKey]:
        """Replays per graph (what the steps actually ran)."""
        return Counter({key: step.launches for key, (_, step) in self._steps.items() if step.launches})

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket that holds `batch` requests (None: no graph does; the step runs
        eagerly)."""
        return self._bucket_of.get(batch)

    def capture(self, batch: int, tokens: int, *, all_greedy: bool = True, filters: bool = False,
                has_probs: bool = False, synthetic: bool = False, draft_pools: tuple[int, int] | None = None,
                uniform_pools: tuple[int, int] | None = None) -> None:
        """Capture one graph ahead of use (an engine does its common shapes at start). The
        buffers start zeroed: every row verifies 0 tokens, so this touches no state."""
        key = GraphKey(batch, tokens, all_greedy, filters, has_probs, synthetic, draft_pools, uniform_pools)
        if self.bucket(batch) != batch:
            raise ValueError(f"capture of batch {batch}, T={tokens}: not a bucket of this target "
                             f"(buckets {self.buckets})")
        if key not in self._steps:
            step = _StaticStep(self, key)
            self._steps[key] = (self._capture(key, step), step)

    def _capture(self, key: GraphKey, step: _StaticStep) -> StepGraph:
        self.enabled.fill_(0)
        try:
            graph = StepGraph(step, f"engine step (batch bucket {key.batch}, T={key.tokens})", pool=self._pool)
        finally:
            self.enabled.fill_(1)
        self._pool = graph.pool
        return graph

    def launch(self, slots: list[int], free_slots: list[int], drafts: torch.Tensor, num_drafts: torch.Tensor,
               probs: torch.Tensor | None, sampling: SamplingTensors, uniforms: torch.Tensor | None,
               noise: torch.Tensor | None, cond_rates: torch.Tensor | None = None, *, draft_pools=None,
               uniform_pools=None) -> "PendingStep":
        """Launch one step for requests in `slots` (padding rows take `free_slots`), each verifying
        its slot's anchor first, and queue its readback; nothing waits for the device. drafts
        [B, T - 1], num_drafts [B], probs [B, T - 1, V] or None, uniforms [B, >= T - 1] and noise
        [B, V] or None (all-greedy standard acceptance reads neither), cond_rates [T - 1] for
        synthetic acceptance (None: rejection sampling) are device tensors. draft_pools /
        uniform_pools: the DrawPools whose latest draws the rows of drafts / uniforms are (one per
        request), or None; when given (and of one shape), the graph reads the rows from its
        DrawMirror instead of having them copied in.

        At most two launches may be unread at a time (the readback buffers alternate), and a
        launch for another set of slots must come after every earlier one was read (the slots'
        pinned buffer is rewritten then, and the graph copies it in when it runs)."""
        B, T = len(slots), drafts.shape[1] + 1
        Bk = self.bucket(B)
        if Bk is None:
            raise ValueError(f"batch of {B}: no CUDA-graph bucket holds it (buckets {self.buckets})")
        if len(free_slots) < Bk - B:
            raise ValueError(f"batch of {B} in bucket {Bk}: needs {Bk - B} free slots for padding, have {len(free_slots)}")
        draft_shape = _mirrored_shape(draft_pools, T)
        uniform_shape = _mirrored_shape(uniform_pools, T) if uniforms is not None else None
        key = GraphKey(Bk, T, bool(sampling.all_greedy), bool(sampling.filters), probs is not None,
                       cond_rates is not None, draft_shape, uniform_shape)
        if draft_shape is not None:
            self.mirror("drafts", draft_shape).prepare(slots, draft_pools)
        if uniform_shape is not None:
            self.mirror("uniforms", uniform_shape).prepare(slots, uniform_pools)
        inputs = (slots, free_slots, drafts, num_drafts, probs, sampling, uniforms, noise, cond_rates)
        found = self._steps.get(key)
        if found is None:
            step = _StaticStep(self, key)
            self._fill(step, *inputs)
            found = self._steps[key] = (self._capture(key, step), step)
        graph, step = found
        self._fill(step, *inputs)
        packed = graph.replay()[0]
        parity = step.launches % 2
        step.launches += 1
        step.host_out[parity].copy_(packed, non_blocking=True)
        step.done[parity].record(current_stream(self._device_index))
        return PendingStep(step, parity, B, step.outputs(graph, B))

    def run(self, slots: list[int], free_slots: list[int], drafts: torch.Tensor, num_drafts: torch.Tensor,
            probs: torch.Tensor | None, sampling: SamplingTensors, uniforms: torch.Tensor | None,
            noise: torch.Tensor | None, cond_rates: torch.Tensor | None = None, *, draft_pools=None,
            uniform_pools=None) -> GraphStepResult:
        """launch(...) and wait for its result."""
        return self.launch(slots, free_slots, drafts, num_drafts, probs, sampling, uniforms, noise, cond_rates,
                           draft_pools=draft_pools, uniform_pools=uniform_pools).result()

    def _fill(self, step: _StaticStep, slots, free_slots, drafts, num_drafts, probs, sampling,
              uniforms, noise, cond_rates) -> None:
        B, Bk, T = len(slots), step.key.batch, step.key.tokens
        # Written through a NumPy view of the pinned buffer, made once (making it costs ~11 us): one
        # torch indexing op costs the host several microseconds (experiments/results/h200/
        # engine_host_profile_1c6ffd9.json). Written only when the batch changed: a step launched before the
        # previous one ran finds it as it was, while that one's graph may still be about to copy it
        # in; when the batch changes every earlier launch was read back (launch's contract).
        rows_now = (tuple(slots), tuple(free_slots[: Bk - B]))
        if self._rows_written.get(Bk) != rows_now:
            rows = self.host_rows(Bk)[1]
            rows[0, :B] = slots
            rows[0, B:] = rows_now[1]
            rows[1, :B], rows[1, B:] = 1, 0
            self._rows_written[Bk] = rows_now
        views = step.inputs(B)  # the buffers' rows, sliced once (a slice is a torch call)
        if T > 1:  # at T = 1 there are no drafts, and num_drafts stays the zeros it was made as
            if step.key.draft_pools is None:
                views.drafts.copy_(drafts)
            # Every row drafting k is one immutable tensor per batch size (full_draft_counts): a copy
            # of it stays valid, and a copy call took the host ~10 us on the H200 under cProfile.
            if num_drafts is not step.counts_source:
                views.num_drafts.copy_(num_drafts)
                step.counts_source = num_drafts if is_full_draft_counts(num_drafts) else None
        if step.sampling_source is not sampling:  # parameters change only when the batch does
            for name in ("temperature", "top_k", "top_p"):
                getattr(step.sampling, name)[:B].copy_(getattr(sampling, name))
            step.sampling_source = sampling
        if probs is not None:
            views.probs.copy_(probs)
        if uniforms is not None and T > 1 and step.key.uniform_pools is None:  # T - 1 wide: no slice then
            views.uniforms.copy_(uniforms if uniforms.shape[1] == T - 1 else uniforms[:, : T - 1])
        if noise is not None:
            views.noise.copy_(noise)
        # The same tensor holds the same rates: the engine makes each k's once and never writes them.
        if cond_rates is not None and step.rates_source is not cond_rates:
            step.cond_rates[: cond_rates.shape[0]].copy_(cond_rates)
            step.rates_source = cond_rates
