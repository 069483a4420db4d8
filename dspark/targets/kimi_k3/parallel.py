"""What a rank's forward does beyond the whole model's (docs/kimi-k3.md §8): the collectives, the
vocabulary-parallel embedding and logits, and which (token, expert) pairs its experts take.

The collectives are an object with `all_reduce(x)` (the sum over ranks, the same tensor on every
rank) and `all_gather(x)` (the ranks' tensors side by side along the last dimension, in rank
order). One GPU cannot run them: `OmittedCollectives` stands in, so the rank's step costs what
it costs one GPU of the deployment, collectives excluded (the projection adds them: dspark
roofline --measured). The CPU tests run every rank of a small model with real ones
(tests/test_k3_rank.py), which proves the shard math.

Routing (which of the rank's experts a step touches):
- "exact": the router's own choice. Rank r takes the pairs whose expert is one of its own; a
  row's other pairs become weight-0 pairs on distinct local experts that row does not use (the
  MoE op takes a fixed [M, k]), so the weighted sums are the rank's share exactly, but up to k
  extra experts a row are read: for correctness, not for timing.
- "busiest": the step of the rank that bounds the deployment. With uniform routing the busiest
  of `world` ranks holds E[max experts per rank] of the step's distinct experts
  (dspark.targets.kimi_k3.sizes.expected_max_experts_per_rank: 3.05 at one token, 12.28 at 8 for K3 on 16
  ranks); this rank runs that many, rounded, spread over its block, each token taking
  ceil(n / tokens) of them in turn, weighted by its router's first weights. The router runs in
  full (its cost is real); only the choice among the rank's experts is this rule.
"""
from __future__ import annotations

import math

import torch

from dspark.kernels import ops

from .config import K3Config
from .sharding import Shard
from .sizes import distinct_experts, expected_max_experts_per_rank

ROUTING_MODES = ("exact", "busiest")


class OmittedCollectives:
    """One GPU's stand-in: all_reduce returns the rank's partial sum as it is (no kernel);
    all_gather repeats the rank's part `world` times (one small copy), so every shape downstream
    is the deployment's."""

    def __init__(self, world: int):
        self.world = world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(*([1] * (x.dim() - 1)), self.world)

    def gather_dispatch_inputs(self, partials: torch.Tensor, router_width: int, dtype: torch.dtype):
        """RankParallel.dispatch_inputs in one launch (ops.moe_dispatch_inputs writes the world's copies):
        the one-shot gather a deployment would run, its sender adding its GEMM's partials first."""
        return ops.moe_dispatch_inputs(partials, router_width, dtype, self.world)


def exact_local_pairs(ids: torch.Tensor, weights: torch.Tensor, first: int, count: int):
    """(local ids, weights) [M, k] of a rank holding experts [first, first + count) from the
    router's global ids / weights [M, k]: its own pairs as they are; every other pair of a row
    gets a distinct local expert that row does not use, weighted 0 (needs count >= k)."""
    local = ids - first
    mine = (local >= 0) & (local < count)
    rows = ids.shape[0]
    # used[m, e]: row m routes to local expert e (column `count` collects the foreign pairs)
    used = torch.zeros(rows, count + 1, dtype=torch.bool, device=ids.device)
    used.scatter_(1, torch.where(mine, local, count), True)
    # the local experts a row does not use, ascending, then the used ones
    key = used[:, :count].long() * count + torch.arange(count, device=ids.device)
    free = torch.argsort(key, dim=1)
    nth_foreign = (torch.cumsum((~mine).long(), dim=1) - 1).clamp(min=0)
    fill = free.gather(1, nth_foreign)
    return torch.where(mine, local, fill), torch.where(mine, weights, torch.zeros_like(weights))


def busiest_rank_experts(cfg: K3Config, world: int, tokens: int) -> int:
    """Distinct experts per MoE layer on the busiest of `world` expert-parallel ranks for a step of
    `tokens` routed tokens under uniform routing, rounded (at least 1)."""
    distinct = distinct_experts(cfg, tokens)
    return max(1, round(expected_max_experts_per_rank(cfg.num_experts, world, distinct)))


def busiest_table(tokens: int, experts: int, count: int) -> torch.Tensor:
    """[tokens, ceil(experts / tokens)] local ids: `experts` distinct experts spread evenly over
    [0, count), token t taking experts t*c, t*c + 1, ... (mod `experts`): distinct within a row,
    every one of them used."""
    per_token = math.ceil(experts / tokens)
    spread = [j * count // experts for j in range(experts)]
    return torch.tensor([[spread[(t * per_token + j) % experts] for j in range(per_token)] for t in range(tokens)])


class RankParallel:
    """Rank `shard` of a K3 model: its collectives, its vocabulary and expert blocks, its routing."""

    def __init__(self, cfg: K3Config, shard: Shard, collectives=None, routing: str = "exact"):
        if routing not in ROUTING_MODES:
            raise ValueError(f"routing={routing!r}: must be one of {list(ROUTING_MODES)}")
        self.cfg, self.shard, self.routing = cfg, shard, routing
        self.collectives = collectives if collectives is not None else OmittedCollectives(shard.world)
        self.vocab = shard.part(cfg.vocab_size)
        self.latent = shard.part(cfg.latent_size)
        self.experts = shard.experts(cfg)
        self._tables: dict[tuple[int, torch.device], torch.Tensor] = {}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_gather(x)

    def dispatch_inputs(self, partials: torch.Tensor, router_width: int, dtype: torch.dtype):
        """(logits [M, E] fp32, latent [M, latent] in `dtype`) from the rank's router | latent-down GEMM
        partials [S, M, E' + latent'] (ops.linear_partials): summed, split, each part all-gathered. The
        collectives' own `gather_dispatch_inputs` when they have one; else ops.moe_dispatch_inputs sums
        and splits them and the collectives gather each part."""
        fused = getattr(self.collectives, "gather_dispatch_inputs", None)
        if fused is not None:
            return fused(partials, router_width, dtype)
        logits, latent = ops.moe_dispatch_inputs(partials, router_width, dtype, 1)
        return self.all_gather(logits), self.all_gather(latent)

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel embedding: the rows of the rank's ids (zeros for the others), summed."""
        local = ids - self.vocab.start
        mine = (local >= 0) & (local < table.shape[0])
        rows = table[torch.where(mine, local, 0)] * mine.unsqueeze(-1).to(table.dtype)
        return self.all_reduce(rows)

    def local_pairs(self, ids: torch.Tensor, weights: torch.Tensor):
        """(local ids, weights) of the pairs the rank's experts take (module docstring)."""
        if self.routing == "exact":
            return exact_local_pairs(ids, weights, self.experts.start, len(self.experts))
        key = (ids.shape[0], ids.device)
        if key not in self._tables:  # built in the first (eager) step, before any graph capture
            n = busiest_rank_experts(self.cfg, self.shard.world, ids.shape[0])
            self._tables[key] = busiest_table(ids.shape[0], n, len(self.experts)).to(ids.device)
        table = self._tables[key]
        return table, weights[:, : table.shape[1]]
