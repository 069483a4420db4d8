"""What a step verifies and the draws its acceptance reads (docs/architecture.md §5, steps 2 and
4): k for the batch, each request's cap, the drafter's proposal cut by the verification policy,
the batch's sampling tensors, and each request's uniforms and race noise from its own generator.
"""
from __future__ import annotations

import dataclasses

import torch

from .config import SpecConfig
from .kernels import registry
from .protocols import Drafter, Proposal
from .requests import Request
from .sampling import DrawPool, SamplingTensors, conditional_rates
from .step import full_draft_counts
from .transfer import long_tensor_on


def check_profile_kernels(profile) -> tuple[tuple[str, str], ...]:
    """The batch-1 profile's kernel overrides, checked against the registry."""
    if profile is None:
        return ()
    for op, impl in profile.kernels:
        known = registry.implementations(op)
        if impl not in known:
            raise ValueError(f"SpecConfig.batch1_profile.kernels: {op}={impl!r} is not an implementation; have {sorted(known)}")
    return tuple(profile.kernels)


class Drafting:
    """The drafting side of an engine's steps, for `target` and `drafter` (None: plain decoding)
    under `spec`. policy: a verification policy object instead of the spec's (for every batch)."""

    def __init__(self, target, drafter: Drafter | None, spec: SpecConfig, policy=None):
        self.target, self.drafter, self.spec = target, drafter, spec
        self.device = torch.device(target.device)
        # Verification-length policies: the configured one, and the batch-1 profile's own.
        # "fixed" needs no policy object: the per-request cap already verifies every draft.
        self.policy = policy if policy is not None else self._make_policy(spec.verify_policy, spec.confidence_threshold)
        profile = spec.batch1_profile
        self.batch1_kernels = check_profile_kernels(profile)
        self.policy_batch1 = self.policy if profile is None or policy is not None else self._make_policy(
            profile.verify_policy, profile.confidence_threshold)
        self._cond_rates: dict[int, torch.Tensor] = {}  # synthetic conditional rates by k
        self._sampling_cache: tuple[tuple[int, ...], SamplingTensors] | None = None
        self.uniform_width = max(spec.max_k, 1)  # of each request's uniforms pool
        # The proposal of a step without drafts, as views (read-only everywhere downstream): no
        # allocation and no kernel launch per plain-decoding step; made once per batch size, as
        # a slice is a torch call of its own.
        self._no_drafts = torch.zeros(target.max_slots, 0, dtype=torch.long, device=self.device)
        self._zero_drafts = torch.zeros(target.max_slots, dtype=torch.long, device=self.device)
        self._plain_proposals: dict[int, Proposal] = {}

    @property
    def synthetic(self) -> bool:
        return self.spec.rejection_sample_method == "synthetic"

    def set_spec(self, spec: SpecConfig) -> None:
        """Another k and acceptance mode for the steps from now on (the drafter stays)."""
        if spec.max_k > 0 and self.drafter is None:
            raise ValueError(f"SpecConfig.num_speculative_tokens={spec.max_k}: speculation needs a drafter")
        self.spec, self._cond_rates = spec, {}

    def step_k(self, batch_size: int) -> int:
        """k for a step of this many requests (SpecConfig.k_for_batch)."""
        return self.spec.k_for_batch(batch_size)

    def policy_for(self, batch_size: int):
        """The verification policy of a step of this many requests (None: verify every draft)."""
        return self.policy_batch1 if batch_size == 1 else self.policy

    def cond_rates(self, k: int) -> torch.Tensor | None:
        """Synthetic acceptance's conditional rates [k] (made once per k and never written, so a
        graphed step copies them in only when they change); None: rejection sampling."""
        if not self.synthetic:
            return None
        if k not in self._cond_rates:
            rates = conditional_rates(list(self.spec.synthetic_rates(k)))
            self._cond_rates[k] = torch.tensor(rates, dtype=torch.float32, device=self.device)
        return self._cond_rates[k]

    def propose(self, reqs: list[Request], k_req: list[int], kmax: int,
                anchors: torch.Tensor | None) -> tuple[Proposal, tuple | None]:
        """The drafts each request verifies (at most k_req[i]), and the DrawPools the drafts' rows
        are the latest draws of (Drafter.draft_pools; None when they are not, or were rearranged)."""
        B = len(reqs)
        if kmax == 0:
            if B not in self._plain_proposals:
                self._plain_proposals[B] = Proposal(self._no_drafts[:B], self._zero_drafts[:B])
            return self._plain_proposals[B], None
        rows = [i for i in range(B) if k_req[i] > 0]
        sub = rows if len(rows) < B else None
        pick = (lambda xs: [xs[i] for i in rows]) if sub else (lambda xs: xs)
        slots = pick([r.slot for r in reqs])
        prop = self.drafter.propose(
            slots,
            anchors[torch.tensor(rows, device=self.device)] if sub and anchors is not None else anchors,
            kmax,
            pick([r.params for r in reqs]),
            pick([r.generator for r in reqs]),
        )
        if prop.num_drafts is None:  # every row drafted kmax
            prop = dataclasses.replace(prop, num_drafts=full_draft_counts(len(slots), kmax, self.device))
        num = prop.num_drafts.to(self.device)
        if any(k_req[i] < kmax for i in rows):
            num = torch.minimum(num, long_tensor_on([k_req[i] for i in rows], self.device))
        policy = self.policy_for(B)
        if policy is not None:
            num = torch.minimum(num, policy.verify_lengths(dataclasses.replace(prop, num_drafts=num)))
        if sub is None:  # the drafter's own where nothing capped it: a replace is host time of its own
            own = prop if num is prop.num_drafts else dataclasses.replace(prop, num_drafts=num)
            return own, self.drafter.draft_pools(slots)
        # Scatter the proposing rows back into the full batch; the others verify no drafts.
        idx = torch.tensor(rows, device=self.device)

        def scatter(proposed: torch.Tensor | None, fill: torch.Tensor | float) -> torch.Tensor | None:
            if proposed is None:
                return None
            full = torch.empty(B, *proposed.shape[1:], dtype=proposed.dtype, device=self.device)
            full[:] = fill
            full[idx] = proposed
            return full

        # Rows without drafts verify none: their draft tokens are never read.
        return Proposal(scatter(prop.tokens, 0), scatter(num, 0), scatter(prop.probs, 1.0),
                        scatter(prop.confidence, 0.0), scatter(prop.confidence_logits, 0.0)), None

    def sampling_tensors(self, reqs: list[Request]) -> SamplingTensors:
        """The batch's sampling parameters as tensors, rebuilt only when the batch changes."""
        ids = tuple(r.out.request_id for r in reqs)
        if self._sampling_cache is None or self._sampling_cache[0] != ids:
            self._sampling_cache = (ids, SamplingTensors.from_params([r.params for r in reqs], self.device))
        return self._sampling_cache[1]

    def draws(self, reqs: list[Request], sampling: SamplingTensors) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-request randomness from each request's own generator, so a seeded request gives the
        same output whatever else is in the batch: uniforms [B, uniform_width] (a step of k reads
        the first k columns) and race noise [B, V]; None for what the acceptance does not read:
        all-greedy standard acceptance reads neither, greedy rows no race noise."""
        if sampling.all_greedy and not self.synthetic:
            return None, None
        draws = [self._uniforms_row(r) for r in reqs]
        # At batch 1 the pool's row itself (a cat is a launch and host time of its own).
        uniforms = draws[0] if len(draws) == 1 else torch.cat(draws)
        if sampling.all_greedy:
            return uniforms, None
        return uniforms, self.noise(reqs)

    def noise(self, reqs: list[Request]) -> torch.Tensor:
        """Race noise [B, V]: Exp(1) from each sampling request's generator, ones for greedy rows."""
        noise = torch.ones(len(reqs), self.target.vocab_size, device=self.device)
        for i, r in enumerate(reqs):
            if not r.params.greedy:
                noise[i].exponential_(generator=r.generator)
        return noise

    def _uniforms_row(self, r: Request) -> torch.Tensor:
        if r.uniforms is None:
            r.uniforms = DrawPool.uniform(r.generator, self.uniform_width)
        return r.uniforms.next()

    def _make_policy(self, name: str, threshold: float):
        from .policy import ConfidenceScheduler, make_policy

        if name == "fixed":
            return None
        if name == "scheduler" and self.spec.sps_table_path is None:
            return ConfidenceScheduler(self.profile_sps())
        return make_policy(name, confidence_threshold=threshold, sps_table_path=self.spec.sps_table_path)

    def profile_sps(self):
        """Steps/s of target.verify against the tokens it feeds, measured now on this device
        (the confidence scheduler's cost curve; docs/dspark-algorithm.md §5.3). Runs
        on the last slot before any request holds it and commits nothing."""
        from .policy import SPSTable

        slot = self.target.max_slots - 1
        most = min(self.target.max_slots * (self.spec.max_k + 1), self.target.max_seq_len)
        counts = sorted({1, *range(2, most + 1, max(1, most // 8)), most})
        gen = torch.Generator().manual_seed(self.spec.seed)

        def verify(n: int):
            tokens = torch.randint(0, self.target.vocab_size, (1, n), generator=gen).to(self.device)
            self.target.verify([slot], tokens, torch.tensor([n], device=self.device))

        return SPSTable.profile(verify, counts, warmup=1, repeats=3)
