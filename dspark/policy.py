"""Verification-length policies: how many of its proposed drafts each request verifies.

Every policy maps a step's Proposal (dspark/protocols.py) to `verify_lengths(proposal)`, a
LongTensor [B] with 0 <= length[r] <= min(num_drafts[r], k). The engine feeds each request its
anchor plus that many drafts to the target.

- FixedK: verify everything proposed (up to k).
- ConfidenceThreshold: DeepSpec's static rule (docs/dspark-algorithm.md §5.5).
- ConfidenceScheduler: the paper's hardware-aware prefix scheduler, Algorithm 1 (§5.3), with its
  early stop, over an SPSTable of measured steps/s vs verified tokens.

The policies read Proposal.confidence as it comes: already calibrated. Calibration temperatures
are applied in one place, `calibrated_confidence`, which the DSpark drafter calls when it reports
confidence and the STS fit (drafters/dspark/calibrate.py) calls with its candidate temperatures.
"""
from __future__ import annotations

import csv
import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from dspark.protocols import Proposal


@runtime_checkable
class VerifyPolicy(Protocol):
    def verify_lengths(self, proposal: Proposal) -> torch.Tensor:
        """LongTensor [B]: drafts verified per request, each <= num_drafts[r] and <= k."""


def _check_k(owner: str, k) -> None:
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
        raise ValueError(f"{owner}.k={k!r}: must be an integer >= 0 or None (= the proposal's width)")


def _proposed(proposal: Proposal, k: int | None) -> torch.Tensor:
    """min(num_drafts, k, width) per request, after checking the proposal's shapes."""
    tokens, num = proposal.tokens, proposal.num_drafts
    if tokens.dim() != 2:
        raise ValueError(f"Proposal.tokens has shape {tuple(tokens.shape)}: must be [B, k]")
    if num.shape != (tokens.shape[0],):
        raise ValueError(f"Proposal.num_drafts has shape {tuple(num.shape)}: must be [B] = [{tokens.shape[0]}]")
    width = tokens.shape[1]
    if bool(((num < 0) | (num > width)).any()):
        raise ValueError(f"Proposal.num_drafts={num.tolist()}: entries must be in [0, {width}]")
    limit = width if k is None else min(k, width)
    return num.clamp(max=limit).long()  # the policy's cap k, not a repair of bad input


def _confidence(proposal: Proposal, owner: str) -> torch.Tensor:
    c = proposal.confidence
    if c is None:
        raise ValueError(f"Proposal.confidence=None: {owner} needs the drafter's per-position confidences")
    if c.shape != proposal.tokens.shape:
        raise ValueError(f"Proposal.confidence has shape {tuple(c.shape)}: must match tokens {tuple(proposal.tokens.shape)}")
    if not bool(torch.isfinite(c).all()) or bool(((c < 0) | (c > 1)).any()):
        raise ValueError(f"Proposal.confidence={c.tolist()}: entries must be finite and in [0, 1]")
    return c.double()


def temperature_tensor(temperatures: Sequence[float], width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The first `width` calibration temperatures as a tensor (checked: finite and > 0, enough
    of them), for calibrated_confidence; a caller that scales every step keeps it."""
    temps = [float(t) for t in temperatures]
    if any(not math.isfinite(t) or t <= 0 for t in temps):
        raise ValueError(f"confidence temperatures={temps!r}: must be finite numbers > 0")
    if len(temps) < width:
        raise ValueError(f"confidence temperatures has {len(temps)} entries: the confidence logits have {width} positions")
    return torch.tensor(temps[:width], dtype=dtype, device=device)


def calibrated_confidence(confidence_logits: torch.Tensor,
                          temperatures: Sequence[float] | torch.Tensor | None) -> torch.Tensor:
    """Sequential temperature scaling (docs/dspark-algorithm.md §5.2): c_j = σ(logit_j / T_j) for
    block position j = 0..width-1 of confidence_logits [..., width] (σ(logit_j) without
    temperatures). Order-preserving per position; computed in the logits' dtype. The
    temperatures may come as temperature_tensor's result: a CUDA graph cannot upload them."""
    if temperatures is None:
        return torch.sigmoid(confidence_logits)
    t = temperatures if isinstance(temperatures, torch.Tensor) else temperature_tensor(
        temperatures, confidence_logits.shape[-1], confidence_logits.dtype, confidence_logits.device)
    return torch.sigmoid(confidence_logits / t)


def _within(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool: position j is one of the first lengths[r] of its row."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


class FixedK:
    """Verify every proposed draft, at most k (None = the proposal's width)."""

    def __init__(self, k: int | None = None):
        _check_k("FixedK", k)
        self.k = k

    def verify_lengths(self, proposal: Proposal) -> torch.Tensor:
        return _proposed(proposal, self.k)


class ConfidenceThreshold:
    """Verify the prefix up to (excluding) the first position whose conditional confidence c_j is
    below `threshold` (DeepSpec's `_confident_prefix_length`, docs/dspark-algorithm.md §5.5). threshold 0 verifies
    the whole block."""

    def __init__(self, threshold: float, k: int | None = None):
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"ConfidenceThreshold.threshold={threshold!r}: must be a number in [0, 1]")
        _check_k("ConfidenceThreshold", k)
        self.threshold = float(threshold)
        self.k = k

    def verify_lengths(self, proposal: Proposal) -> torch.Tensor:
        proposed = _proposed(proposal, self.k)
        confident = _confidence(proposal, "ConfidenceThreshold") >= self.threshold
        confident &= _within(proposed, confident.shape[1])
        # Length of the leading run of confident positions: cumprod turns every entry after the first miss to 0.
        return confident.long().cumprod(dim=1).sum(dim=1)


class SPSTable:
    """Target steps per second as a function of the tokens one verify step feeds (all requests).

    Built from profiled sizes. Between sizes the step time (1/SPS) is interpolated linearly; below
    the smallest size the smallest's rate holds; above the largest the last segment's time slope
    continues (as vLLM's cost tables do, docs/dspark-algorithm.md §5.6). The table is made monotone on construction:
    more tokens never give more steps/s (a running minimum over sizes absorbs timing noise).
    """

    def __init__(self, token_counts: Sequence[int], steps_per_s: Sequence[float]):
        counts, rates = list(token_counts), list(steps_per_s)
        if not counts:
            raise ValueError("SPSTable.token_counts=[]: needs at least one profiled size")
        if len(counts) != len(rates):
            raise ValueError(f"SPSTable.steps_per_s has {len(rates)} entries: must match token_counts ({len(counts)})")
        for n in counts:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"SPSTable.token_counts={counts!r}: entry {n!r} must be an integer >= 1")
        if any(b <= a for a, b in zip(counts, counts[1:])):
            raise ValueError(f"SPSTable.token_counts={counts!r}: must be strictly increasing")
        for s in rates:
            if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s) or s <= 0:
                raise ValueError(f"SPSTable.steps_per_s={rates!r}: entry {s!r} must be a finite number > 0")
        monotone = []
        for s in rates:
            monotone.append(min(s, monotone[-1]) if monotone else float(s))
        self.token_counts = counts
        self.steps_per_s = monotone

    def __call__(self, num_tokens: int) -> float:
        """Steps/s for a step of `num_tokens` tokens."""
        return float(self.rates(torch.tensor([num_tokens]))[0])

    def rates(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """Steps/s (float64) for each entry of `num_tokens`."""
        n = num_tokens.double().cpu()
        counts = torch.tensor(self.token_counts, dtype=torch.float64)
        times = 1.0 / torch.tensor(self.steps_per_s, dtype=torch.float64)
        if len(counts) == 1:
            return torch.full_like(n, self.steps_per_s[0])
        # The segment [lo, hi] holding n; above the table the last segment, extended.
        hi = torch.searchsorted(counts, n).clamp(1, len(counts) - 1)
        lo = hi - 1
        slope = (times[hi] - times[lo]) / (counts[hi] - counts[lo])
        step_time = torch.where(n <= counts[0], times[0], times[lo] + slope * (n - counts[lo]))
        return 1.0 / step_time

    @classmethod
    def from_file(cls, path: str | Path) -> "SPSTable":
        """JSON {"token_counts": [...], "steps_per_s": [...]} or CSV with a header row
        `token_counts,steps_per_s` (one row per profiled size)."""
        path = Path(path)
        if path.suffix.lower() == ".json":
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or "token_counts" not in data or "steps_per_s" not in data:
                raise ValueError(f"sps_table_path={str(path)!r}: JSON must hold 'token_counts' and 'steps_per_s' lists")
            return cls(data["token_counts"], data["steps_per_s"])
        if path.suffix.lower() == ".csv":
            with path.open(newline="") as f:
                rows = list(csv.DictReader(f))
            if rows and not {"token_counts", "steps_per_s"} <= set(rows[0]):
                raise ValueError(f"sps_table_path={str(path)!r}: CSV header must be token_counts,steps_per_s")
            return cls([int(r["token_counts"]) for r in rows], [float(r["steps_per_s"]) for r in rows])
        raise ValueError(f"sps_table_path={str(path)!r}: must end in .json or .csv")

    def to_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"token_counts": self.token_counts, "steps_per_s": self.steps_per_s}, indent=1))

    @classmethod
    def profile(
        cls,
        step_fn: Callable[[int], object],
        token_counts: Sequence[int],
        warmup: int = 2,
        repeats: int = 5,
    ) -> "SPSTable":
        """Time `step_fn(num_tokens)` (one target step of that many tokens) on the current
        device: `warmup` untimed calls, then the median of `repeats` timed ones. On CUDA the clock
        stops after a synchronize, so queued kernels are counted."""
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"SPSTable.profile warmup={warmup!r}: must be an integer >= 0")
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"SPSTable.profile repeats={repeats!r}: must be an integer >= 1")
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        rates = []
        for n in token_counts:
            for _ in range(warmup):
                step_fn(n)
            sync()
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                step_fn(n)
                sync()
                seconds.append(time.perf_counter() - start)
            rates.append(1.0 / max(statistics.median(seconds), 1e-9))
        return cls(list(token_counts), rates)


class ConfidenceScheduler:
    """Algorithm 1 of the DSpark paper (docs/dspark-algorithm.md §5.3): choose per-request verification lengths that
    maximise Θ = τ·SPS(B), where B = Σ_r (1 + ℓ_r) tokens are verified and τ = Σ_r (1 + Σ_{j≤ℓ_r} a_rj)
    tokens are expected to be emitted, a_rj = Π_{i≤j} c_ri being the survival of draft j.

    Candidates (r, j) with a_rj > 0 are admitted greedily in order of decreasing a_rj (a request's
    drafts come in prefix order since a_rj is non-increasing in j). Admission stops at the first
    candidate that does not raise Θ above the best so far: the EARLY STOP. It keeps the rule
    non-anticipating: a_r,j+1 depends on the realised draft x_rj, so looking past a point where
    Θ fell and coming back to admit x_rj would make the verified length depend on x_rj and bias
    the output (Appendix A). `early_stop=False` scans the whole pool and keeps the best Θ; it
    exists only to reproduce that counterexample.
    """

    def __init__(self, sps_table: SPSTable, k: int | None = None, early_stop: bool = True):
        if not isinstance(sps_table, SPSTable):
            raise ValueError(f"ConfidenceScheduler.sps_table={sps_table!r}: must be an SPSTable")
        _check_k("ConfidenceScheduler", k)
        self.sps = sps_table
        self.k = k
        self.early_stop = early_stop

    def verify_lengths(self, proposal: Proposal) -> torch.Tensor:
        proposed = _proposed(proposal, self.k)
        c = _confidence(proposal, "ConfidenceScheduler")
        R, width = c.shape
        survival = torch.cumprod(c, dim=1) * _within(proposed, width)  # a[r][j], 0 outside the proposal

        # The pool, ranked by a descending; ties keep (position, request) order so a request's
        # positions with equal survival (c = 1) are admitted in prefix order.
        a = survival.cpu().T.reshape(-1)  # position-major: (j=0, r=0), (j=0, r=1), ...
        request = torch.arange(R).repeat(width)
        keep = a > 0
        a, request = a[keep], request[keep]
        order = torch.sort(a, descending=True, stable=True).indices
        a, request = a[order], request[order]

        # Θ after admitting the first i candidates, i = 0..len(pool): B = R + i, τ = R + Σ a.
        admitted = torch.arange(len(a) + 1)
        tau = R + torch.cat([torch.zeros(1, dtype=a.dtype), torch.cumsum(a, dim=0)])
        theta = tau * self.sps.rates(R + admitted)
        if self.early_stop:
            # Admit while every admission strictly improves Θ; stop at the first that does not.
            not_better = (theta[1:] <= theta[:-1]).nonzero()
            count = int(not_better[0]) if len(not_better) else len(a)
        else:
            count = int(torch.argmax(theta))  # the first maximum; 0 when nothing beats Θ0
        lengths = torch.bincount(request[:count], minlength=R)
        return lengths.to(device=proposal.num_drafts.device, dtype=torch.long)


def make_policy(
    name: str,
    k: int | None = None,
    confidence_threshold: float = 0.0,
    sps_table_path: str | None = None,
) -> VerifyPolicy:
    """The policy a SpecConfig / Profile names (`verify_policy`, `confidence_threshold`,
    `sps_table_path`)."""
    if name == "fixed":
        return FixedK(k)
    if name == "threshold":
        return ConfidenceThreshold(confidence_threshold, k)
    if name == "scheduler":
        if sps_table_path is None:
            raise ValueError("sps_table_path=None: verify_policy='scheduler' needs a steps/s table (SPSTable file)")
        return ConfidenceScheduler(SPSTable.from_file(sps_table_path), k)
    raise ValueError(f"verify_policy={name!r}: must be 'fixed', 'threshold' or 'scheduler'")
