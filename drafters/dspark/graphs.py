"""CUDA graphs of the DSpark drafter's draft and commit (the drafter's step on the device).

Eagerly, one greedy draft is a few hundred small launches (the backbone, the lm_head, and the
Markov loop's gather, product and argmax per block slot) and a commit a few dozen; the host issues
each. Here each is one graph replay per step:

- draft graphs are keyed by (batch bucket, context bucket): the bucket of the batch (1, 2, 4, 8:
  dspark.cuda_graphs.BUCKETS, those of the engine's step graphs) and a power of two >= the longest
  context of the batch, the cache rows a replay reads (rows past a request's own length are
  masked, as in the eager draft). The slots and anchors are copied into the graph's static
  inputs, padding rows taking slots outside the batch; the lengths are read on the device.
- commit graphs (of DSparkDrafter.commit, a commit the host drives) are keyed by (batch bucket, T)
  and run DSparkDrafter._commit_rows: every one of the T verified rows of a request is computed
  (as eagerly) and written, the rows past its kept count to the cache's scratch row (index
  max_seq_len), and its device length advanced by the kept count. Padding rows take slots outside
  the batch with a kept count of 0: they write only scratch rows and rewrite their own length
  unchanged. In an engine the drafter commits on the device instead, inside the engine's step
  (commit_on_device, captured into the step's own graph).

Only greedy drafting is graphed (probabilistic drafting samples with each request's host
generator). Batches larger than the largest bucket draft and commit eagerly. A draft's outputs
are views of the graph's static outputs: valid until the next draft of the same graph.

Turned on by DSparkDrafter(cuda_graphs=True), which dspark.build.build_drafter passes for a CUDA
target unless the batch-1 profile turns graphs off (experiments/drafter_bench.py measures the
graphed draft and commit against the eager ones).
"""
from __future__ import annotations

import torch

from dspark.cuda_graphs import BUCKETS, StepGraph, bucket_table

MIN_CONTEXT = 64  # the smallest context bucket


def context_bucket(longest: int, max_seq_len: int) -> int:
    """The cache rows a draft graph reads: a power of two >= longest (at least MIN_CONTEXT), at
    most max_seq_len."""
    size = MIN_CONTEXT
    while size < longest:
        size *= 2
    return min(size, max_seq_len)


class _Draft:
    def __init__(self, drafter, batch: int, context: int, pool):
        dev = drafter.device
        self.index = torch.zeros(batch, dtype=torch.long, device=dev)  # slots, padding included
        self.slots: tuple[int, ...] | None = None  # what index holds (DraftGraphs._copy_slots)
        self.anchors = torch.zeros(batch, dtype=torch.long, device=dev)
        self._views: dict[int, object] = {}

        def step():
            return drafter._draft_rows(self.index, self.anchors, context)

        self.graph = StepGraph(step, f"DSpark draft (batch bucket {batch}, context {context})", pool=pool)

    def outputs(self, B: int):
        """The draft's outputs over the first B rows, made once per B."""
        if B not in self._views:
            out = self.graph.outputs  # a drafter.Draft
            self._views[B] = type(out)(out.tokens[:B], None, out.confidence_logits[:B], out.confidence[:B])
        return self._views[B]


class _Commit:
    def __init__(self, drafter, batch: int, tokens: int, pool):
        dev, c = drafter.device, drafter.config
        self.index = torch.zeros(batch, dtype=torch.long, device=dev)
        self.slots: tuple[int, ...] | None = None  # what index holds (DraftGraphs._copy_slots)
        self.kept = torch.zeros(batch, dtype=torch.long, device=dev)  # 0: the capture's runs keep nothing
        self.taps = {layer: torch.zeros(batch, tokens, c.target_hidden_size, device=dev,
                                        dtype=drafter.model.context_proj.weight.dtype)
                     for layer in drafter.tap_layers}

        def step():
            drafter._commit_rows(self.index, self.kept, self.taps)

        self.graph = StepGraph(step, f"DSpark commit (batch bucket {batch}, T={tokens})", pool=pool)


class DraftGraphs:
    """The draft and commit graphs of one DSparkDrafter (made on first use of each key)."""

    def __init__(self, drafter, buckets=BUCKETS):
        self.drafter = drafter
        self.buckets, self._bucket_of = bucket_table(buckets, drafter.max_slots)
        self._drafts: dict[tuple[int, int], _Draft] = {}
        self._commits: dict[tuple[int, int], _Commit] = {}
        self._pool = None
        self.replays = {"draft": 0, "commit": 0}

    def bucket(self, batch: int) -> int | None:
        return self._bucket_of.get(batch)

    def _padding(self, slots: list[int], count: int) -> list[int]:
        """`count` slots outside the batch (a padding row must not share a real row's slot)."""
        taken = set(slots)
        return [s for s in range(self.drafter.max_slots) if s not in taken][:count]

    def _copy_slots(self, graph, slots: list[int]) -> None:
        """Copy `slots` into the graph's index only when it holds others (nothing else writes it).
        An upload every call would make the host wait at each step launched ahead: the staging
        buffer's previous copy is queued behind the step still running (dspark/transfer.py), and
        such waits were most of a plain step with a graphed drafter (experiments/notes/step.md)."""
        key = tuple(slots)
        if graph.slots != key:
            graph.index[:len(slots)].copy_(self.drafter._staging.upload(slots), non_blocking=True)
            graph.slots = key

    def draft(self, slots: list[int], anchors: torch.Tensor):
        """The graphed greedy draft of `slots`, or None when no bucket holds the batch."""
        B = len(slots)
        Bk = self.bucket(B)
        if Bk is None:
            return None
        context = context_bucket(max(self.drafter._lengths[s] for s in slots), self.drafter.max_seq_len)
        key = (Bk, context)
        graph = self._drafts.get(key)
        if graph is None:
            graph = self._drafts[key] = _Draft(self.drafter, Bk, context, self._pool)
            self._pool = graph.graph.pool
        # Padding rows take slots outside the batch: a draft writes its block's rows into each
        # row's slot past its length (drafters/dspark/model.py CachedContext), and a padding row
        # on a batch row's slot would write over that row's block.
        self._copy_slots(graph, slots + self._padding(slots, Bk - B))
        graph.anchors[:B].copy_(anchors)
        graph.graph.replay()
        self.replays["draft"] += 1
        return graph.outputs(B)

    def commit(self, slots: list[int], num_tokens: torch.Tensor, taps: dict[int, torch.Tensor]) -> bool:
        """The graphed commit (num_tokens [B] device counts, taps {layer: [B, T, d]}); False when
        no bucket holds the batch (the caller commits eagerly)."""
        B = len(slots)
        Bk = self.bucket(B)
        if Bk is None:
            return False
        T = next(iter(taps.values())).shape[1]
        key = (Bk, T)
        graph = self._commits.get(key)
        if graph is None:
            graph = self._commits[key] = _Commit(self.drafter, Bk, T, self._pool)
            self._pool = graph.graph.pool
        self._copy_slots(graph, slots + self._padding(slots, Bk - B))
        graph.kept[:B].copy_(num_tokens)
        if B < Bk:
            graph.kept[B:].zero_()
        for layer in self.drafter.tap_layers:
            graph.taps[layer][:B].copy_(taps[layer])
        graph.graph.replay()
        self.replays["commit"] += 1
        return True
