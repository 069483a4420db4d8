"""Calibrating the confidence head: sequential temperature scaling (STS, docs/dspark-algorithm.md §5.2).

Raw confidence heads are over-confident (ECE 3-8 %, docs/dspark-algorithm.md §11 item 5). STS scales each block
position's logit by its own temperature, c_k = sigmoid(logit_k / T_k), fitting T_1..T_G left to
right on held-out rounds: T_k minimises the ECE of the cumulative product prod_{i<=k} c_i against
the observed prefix acceptance (drafts 1..k all accepted), with T_1..T_{k-1} already frozen.
Scaling is order-preserving per position. The temperatures are stored in the drafter's
config.json (`confidence_temperatures`); dspark.policy.calibrated_confidence is the one function
that applies them, whether the drafter reports confidence or the fit tries a candidate.

The held-out rounds come from the engine (`run_rounds`): speculative decoding with k = the block
size and every draft verified, an observer recording each step's raw confidence logits and how
many drafts were accepted (greedy: while draft == target argmax; T > 0: the lossless rejection
sampler).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from dspark.config import SamplingParams, SpecConfig
from dspark.engine import Engine, StepObserver, StepRecord
from dspark.policy import calibrated_confidence
from dspark.protocols import Drafter

from .drafter import DSparkDrafter


@dataclass
class Rounds:
    confidence_logits: torch.Tensor  # [R, G] raw (uncalibrated) confidence logits
    accepted: torch.Tensor  # [R] drafts accepted in the round (all G were verified)
    # Per prompt (run_rounds): drafts accepted and rounds, over all of its rounds [P]; the unit a
    # bootstrap resamples (acceptance_interval).
    prompt_accepted: torch.Tensor | None = None
    prompt_rounds: torch.Tensor | None = None

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verify (accepted drafts + 1), vLLM's acceptance length."""
        return float(self.accepted.float().mean() + 1) if len(self.accepted) else float("nan")

    def acceptance_interval(self, samples: int = 1000, seed: int = 0) -> list[float]:
        """95% percentile bootstrap interval of acceptance_length over prompts (resampled with
        replacement, each with all of its rounds)."""
        if self.prompt_accepted is None:
            raise ValueError("acceptance_interval: these rounds carry no per-prompt counts (run_rounds makes them)")
        return bootstrap_interval(self.prompt_accepted, self.prompt_rounds, samples, seed)

    def observed(self) -> torch.Tensor:
        """[R, G] float: drafts 1..k were all accepted."""
        G = self.confidence_logits.shape[1]
        return (self.accepted[:, None] > torch.arange(G)).float()


def bootstrap_interval(accepted, rounds, samples: int = 1000, seed: int = 0) -> list[float]:
    """[2.5%, 97.5%] percentiles of (sum accepted + sum rounds) / sum rounds over `samples`
    resamplings of the prompts (accepted, rounds: per-prompt totals [P])."""
    accepted, rounds = torch.as_tensor(accepted, dtype=torch.float64), torch.as_tensor(rounds, dtype=torch.float64)
    if len(rounds) == 0 or rounds.sum() == 0:
        raise ValueError("bootstrap_interval: no rounds to resample")
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(rounds), (samples, len(rounds)), generator=g)
    al = (accepted[picks].sum(1) + rounds[picks].sum(1)) / rounds[picks].sum(1).clamp(min=1)
    low, high = torch.quantile(al, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [round(low, 4), round(high, 4)]


@torch.no_grad()
def run_rounds(
    target,
    drafter: DSparkDrafter | Drafter,
    prompts: list[torch.Tensor],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(temperature=0.0),
    seed: int = 0,
    block_size: int | None = None,
    on_step: StepObserver | None = None,
    graph_buckets: tuple[int, ...] | None = None,
) -> Rounds:
    """Speculative decoding of every prompt on the engine for max_new_tokens tokens, k = the
    block size (the drafter's config.block_size, or block_size for a drafter without one),
    every proposed draft verified; returns every round's raw confidence logits (zeros for a
    drafter without a confidence head) and accepted count. A draft the drafter did not propose
    (an n-gram miss) counts as rejected.

    Each prompt's output is capped so that every round's whole block fits the context
    (target.max_seq_len): the engine would verify fewer drafts near the end, and a round that
    cannot verify the whole block would bias the fit. A prompt with no room for one round gives none.
    on_step: a second engine observer (progress). graph_buckets: the engine's (Engine)."""
    sampling.validate(target.vocab_size)
    G = block_size if block_size is not None else drafter.config.block_size
    recorder = RoundRecorder(G)
    engine = Engine(target, drafter, SpecConfig(num_speculative_tokens=G, seed=seed), graph_buckets=graph_buckets)
    engine.add_observer(recorder)
    if on_step is not None:
        engine.add_observer(on_step)
    # The last round starts with prompt + output - 1 tokens committed and needs G + 1 positions.
    work = [(i, p, min(max_new_tokens, target.max_seq_len - p.shape[0] - G + 1)) for i, p in enumerate(prompts)]
    work = [(i, p, n) for i, p, n in work if n >= 1]
    width = min(target.max_slots, getattr(drafter, "max_slots", target.max_slots))
    prompt_accepted, prompt_rounds = [], []
    for start in range(0, len(work), width):  # the engine then never uses a slot past the drafter's
        chunk = work[start : start + width]
        params = [dataclasses.replace(sampling, max_tokens=n, ignore_eos=True, seed=seed * 100_003 + i) for i, _, n in chunk]
        for (i, _, _), out in zip(chunk, engine.generate([p for _, p, _ in chunk], params)):
            if out.error is not None:
                raise ValueError(f"run_rounds: prompts[{i}]: {out.error}")
            prompt_accepted.append(out.num_accepted_drafts)
            prompt_rounds.append(out.num_steps)
    rounds = recorder.rounds()
    rounds.prompt_accepted = torch.tensor(prompt_accepted, dtype=torch.long)
    rounds.prompt_rounds = torch.tensor(prompt_rounds, dtype=torch.long)
    return rounds


class RoundRecorder:
    """An engine observer that keeps every step's raw confidence logits (zeros for a drafter
    without a confidence head) and accepted counts, for engines whose steps verify whole blocks
    of G drafts (k = G)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.logits: list[torch.Tensor] = []
        self.accepted: list[torch.Tensor] = []

    def __call__(self, step: StepRecord) -> None:
        G, logits = self.block_size, step.proposal.confidence_logits
        if logits is not None and logits.shape[1] != G:
            raise ValueError(f"rounds: the drafter proposed {logits.shape[1]} positions, the block has {G}")
        self.logits.append(logits.float().cpu() if logits is not None else torch.zeros(len(step.request_ids), G))
        self.accepted.append(torch.tensor(step.num_accepted, dtype=torch.long))

    def rounds(self) -> Rounds:
        if not self.logits:
            return Rounds(torch.zeros(0, self.block_size), torch.zeros(0, dtype=torch.long))
        return Rounds(torch.cat(self.logits), torch.cat(self.accepted))


# ---- metrics ----------------------------------------------------------------------------------
def expected_calibration_error(pred: torch.Tensor, observed: torch.Tensor, bins: int = 15) -> float:
    """sum over equal-width bins of (bin share) * |mean prediction - observed rate|."""
    pred, observed = pred.double().flatten(), observed.double().flatten()
    index = (pred * bins).long().clamp(0, bins - 1)
    count = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, torch.ones_like(pred))
    pred_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, pred)
    obs_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, observed)
    return float((pred_sum - obs_sum).abs().sum() / max(len(pred), 1))


def roc_auc(pred: torch.Tensor, observed: torch.Tensor) -> float:
    """Probability that a random positive scores above a random negative (ties count half);
    NaN when one class is absent."""
    pred, observed = pred.double().flatten(), observed.bool().flatten()
    pos, neg = int(observed.sum()), int((~observed).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    # 1-based ranks, averaged over tied predictions
    order = pred.argsort()
    unique, inverse = torch.unique(pred[order], return_inverse=True)
    positions = torch.arange(1, len(pred) + 1, dtype=torch.float64)
    rank_sum = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, positions)
    tie_count = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(positions))
    ranks = torch.empty_like(pred)
    ranks[order] = (rank_sum / tie_count)[inverse]
    return float((ranks[observed].sum() - pos * (pos + 1) / 2) / (pos * neg))


def brier_score(pred: torch.Tensor, observed: torch.Tensor) -> float:
    return float((pred.double() - observed.double()).pow(2).mean())


def survival(confidence_logits: torch.Tensor, temperatures) -> torch.Tensor:
    """Cumulative products prod_{i<=k} sigmoid(logit_i / T_i) [R, G]."""
    return calibrated_confidence(confidence_logits.double(), temperatures).cumprod(dim=1)


def report(rounds: Rounds, temperatures=None) -> dict:
    """ECE, AUC and Brier of the cumulative product per position, and their means."""
    pred, obs = survival(rounds.confidence_logits, temperatures), rounds.observed()
    per = [{"position": k + 1, "ece": expected_calibration_error(pred[:, k], obs[:, k]),
            "auc": roc_auc(pred[:, k], obs[:, k]), "brier": brier_score(pred[:, k], obs[:, k]),
            "observed": float(obs[:, k].mean()), "predicted": float(pred[:, k].mean())} for k in range(pred.shape[1])]
    mean = lambda key: float(torch.tensor([p[key] for p in per if not math.isnan(p[key])] or [float("nan")]).mean())  # noqa: E731
    return {"rounds": len(rounds.accepted), "acceptance_length": rounds.acceptance_length,
            "ece": mean("ece"), "auc": mean("auc"), "brier": mean("brier"), "positions": per}


def fit_temperatures(rounds: Rounds, grid: torch.Tensor | None = None) -> tuple[float, ...]:
    """Sequential temperature scaling: T_k from a log grid on [0.05, 20] minimising the ECE of
    the cumulative product at position k, with T_1..T_{k-1} frozen (docs/dspark-algorithm.md §5.2)."""
    if len(rounds.accepted) == 0:
        raise ValueError("fit_temperatures: no rounds to fit on")
    grid = grid if grid is not None else torch.logspace(math.log10(0.05), math.log10(20.0), 121, dtype=torch.float64)
    logits, obs = rounds.confidence_logits.double(), rounds.observed()
    prefix = torch.ones(len(logits), dtype=torch.float64)
    temps = []
    for k in range(logits.shape[1]):
        column = logits[:, k : k + 1]
        errors = [expected_calibration_error(prefix * calibrated_confidence(column, [t])[:, 0], obs[:, k]) for t in grid]
        best = float(grid[int(torch.tensor(errors).argmin())])
        temps.append(best)
        prefix = prefix * calibrated_confidence(column, [best])[:, 0]
    return tuple(temps)


def calibrate(
    target,
    drafter: DSparkDrafter,
    prompts: list[torch.Tensor],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(temperature=0.0),
    seed: int = 0,
    eval_prompts: list[torch.Tensor] | None = None,
    on_step: StepObserver | None = None,
) -> dict:
    """Fit the STS temperatures on rounds decoded from held-out prompts, install them in the
    drafter's config, and report ECE/AUC/Brier before and after (on eval_prompts too, if given).
    on_step: an engine observer of every decoding step (progress)."""
    rounds = run_rounds(target, drafter, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                        on_step=on_step)
    temps = fit_temperatures(rounds)
    result = {"temperatures": list(temps), "fit": {"before": report(rounds), "after": report(rounds, temps)}}
    if eval_prompts:
        held = run_rounds(target, drafter, eval_prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed + 1,
                          on_step=on_step)
        result["eval"] = {"before": report(held), "after": report(held, temps)}
    drafter.model.config = dataclasses.replace(drafter.model.config, confidence_temperatures=temps).validate()
    return result
