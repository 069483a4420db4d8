"""Training the DSpark drafter online against a live target (docs/dspark-algorithm.md §6).

Each step prefills a batch of training sequences into the target with the drafter's tap layers
(online capture of the tapped hidden states and the target logits), samples up to
`num_anchors` anchors per sequence, builds one block per anchor ([tok[a], MASK...] at positions
a..a+G-1, labels tok[a+1..a+G], §6.2), runs every block in one parallel pass with the Markov and
confidence heads teacher-forced on the true previous tokens, and minimises (§6.3)

    L = 0.1 * CE + 0.9 * ||p_d - p_t||_1 + 1.0 * BCE(conf_logit, 1 - 0.5 * ||p_d - p_t||_1 (detached)),

each term a mean weighted by w_k = exp(-(k-1)/4) over supervised slots. AdamW with linear
warm-up and cosine decay to 0, gradient clipping; checkpoints (safetensors + config.json +
trainer_state.pt) resume exactly; a jsonl loss log and a progress display (dspark.progress).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dspark.targets import eos_ids
from dspark.config import SamplingParams
from dspark.engine import Engine
from dspark.files import file_mode, write_atomic
from dspark.kernels import ops
from dspark.progress import progress as progress_display

from .checkpoint import TRAINER_STATE_FILE, load_trainer_state, load_weights, read_tensors, save_checkpoint
from .model import DSparkModel


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    num_anchors: int = 512
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    decay_gamma: float = 4.0  # all released configs use 4.0, not the block size (docs/dspark-algorithm.md §6.3)
    grad_clip: float = 1.0
    anchor_chunk: int = 0  # > 0: run the blocks this many anchors at a time
    recompute: bool = True  # chunks recompute their activations in backward (memory ~ one chunk's)
    # > 0: batches drawn from groups of this many batches sorted by supervised length (epoch_batches)
    length_groups: int = 0
    seed: int = 42
    save_every: int = 0  # 0: save only at the end

    def validate(self) -> "TrainConfig":
        for name in ("steps", "batch_size", "num_anchors"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainConfig.{name}={v!r}: must be an integer >= 1")
        for name in ("lr", "decay_gamma", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: must be > 0")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"TrainConfig.warmup_frac={self.warmup_frac!r}: must be in [0, 1)")
        for name in ("weight_decay", "ce_weight", "l1_weight", "conf_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: must be >= 0")
        if not isinstance(self.anchor_chunk, int) or self.anchor_chunk < 0:
            raise ValueError(f"TrainConfig.anchor_chunk={self.anchor_chunk!r}: must be an integer >= 0 (0 = all anchors at once)")
        if not isinstance(self.recompute, bool):
            raise ValueError(f"TrainConfig.recompute={self.recompute!r}: must be a bool")
        if not isinstance(self.length_groups, int) or self.length_groups < 0:
            raise ValueError(f"TrainConfig.length_groups={self.length_groups!r}: must be an integer >= 0 (0 = random batches)")
        if not isinstance(self.save_every, int) or self.save_every < 0:
            raise ValueError(f"TrainConfig.save_every={self.save_every!r}: must be an integer >= 0")
        return self


# ---- blocks -----------------------------------------------------------------------------------
def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, num_anchors: int, generator: torch.Generator):
    """Up to num_anchors distinct valid anchors per sequence, uniformly at random, sorted (docs/dspark-algorithm.md §6.2).

    Valid a: a <= len-2, loss_mask[a] and loss_mask[a+1]. Returns anchors [B, A] and keep [B, A]
    (False for padding blocks)."""
    B, S = loss_mask.shape
    pos = torch.arange(S)
    valid = (pos < lengths[:, None] - 1) & loss_mask.bool()
    valid[:, :-1] &= loss_mask[:, 1:].bool()
    valid[:, -1] = False
    keys = torch.rand(B, S, generator=generator).masked_fill(~valid, 2.0)  # random keys, invalid last
    count = min(num_anchors, max(int(valid.sum(1).max()), 1))
    chosen = keys.topk(count, dim=1, largest=False).indices
    keep = valid.gather(1, chosen)
    anchors = torch.where(keep, chosen, torch.zeros_like(chosen))
    order = torch.where(keep, anchors, torch.full_like(anchors, S)).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def build_blocks(tokens, lengths, loss_mask, anchors, keep, block_size: int, mask_token_id: int):
    """Block inputs, positions, labels, teacher-forced previous tokens and the eval mask (docs/dspark-algorithm.md §6.2).

    Slot k (1..G) of the block at anchor a has input tok[a] (k = 1) or MASK, position a+k-1,
    label tok[a+k], previous token tok[a+k-1], and is supervised while every slot up to it is
    inside the sequence and the loss mask: eval_mask[k] = prod_{i<=k} (a+i < len and mask[a+i]).
    """
    B, S = tokens.shape
    offsets = torch.arange(block_size)
    positions = anchors[..., None] + offsets  # a + k - 1
    label_pos = positions + 1
    inside = label_pos < lengths[:, None, None]
    clamped = label_pos.clamp(max=S - 1)
    flat = lambda t, idx: t.gather(1, idx.flatten(1)).view(idx.shape)  # noqa: E731
    labels = flat(tokens, clamped)
    prev = flat(tokens, positions.clamp(max=S - 1))
    supervised = inside & flat(loss_mask, clamped).bool()
    eval_mask = supervised.long().cumprod(dim=-1).bool() & keep[..., None]
    block = torch.full_like(labels, mask_token_id)
    block[..., 0] = flat(tokens, anchors[..., None])[..., 0]
    return block, positions, labels, prev, eval_mask


def loss_sums(draft_logits, target_probs, labels, conf_logits, eval_mask, cfg: TrainConfig,
              target_rows=None) -> dict[str, torch.Tensor]:
    """Weighted sums of the three loss terms and of the diagnostics over a set of blocks; blocks
    can be split into chunks and their sums added (see `finish_loss`).

    draft_logits [..., G, V]; target_probs float32, the target's softmax (taken once per position
    by the caller: neighbouring blocks share positions), either [..., G, V] (one row per slot) or
    [M, V] with target_rows [..., G] naming each slot's row; labels, conf_logits, eval_mask
    [..., G]. The vocabulary-wide terms are the op draft_loss_terms (kernels/draft_loss)."""
    V = draft_logits.shape[-1]
    if target_rows is None:
        target_probs, rows = target_probs.reshape(-1, V), None
    else:
        rows = target_rows.reshape(-1)
    ce, l1 = ops.draft_loss_terms(draft_logits.reshape(-1, V), target_probs, rows, labels.reshape(-1))
    ce, l1 = ce.view(labels.shape), l1.view(labels.shape)
    soft_label = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(conf_logits.float(), soft_label, reduction="none")
    G = labels.shape[-1]
    decay = torch.exp(-torch.arange(G, dtype=torch.float32, device=labels.device) / cfg.decay_gamma)
    weight = decay * eval_mask.float()
    mask_f = eval_mask.float()
    return {
        "ce": (ce * weight).sum(), "l1": (l1 * weight).sum(), "conf": (bce * weight).sum(), "weight": weight.sum(),
        # Diagnostics (docs/dspark-algorithm.md §6.3): accept_rate@k = mean soft label, tau = 1 + sum_k prod_{i<=k} c*_i.
        "accept": (soft_label * mask_f).flatten(0, -2).sum(0), "slots": mask_f.flatten(0, -2).sum(0),
        "tau": ((1 + (soft_label * mask_f).cumprod(dim=-1).sum(-1)) * mask_f[..., 0]).sum(), "blocks": mask_f[..., 0].sum(),
    }


def finish_loss(sums: dict[str, torch.Tensor], cfg: TrainConfig):
    """L = 0.1 CE + 0.9 L1 + 1.0 BCE, each a weighted mean (docs/dspark-algorithm.md §6.3), and the step's metrics."""
    denom = sums["weight"].detach().clamp(min=1e-12)
    ce, l1, conf = (sums[key] / denom for key in ("ce", "l1", "conf"))
    loss = cfg.ce_weight * ce + cfg.l1_weight * l1 + cfg.conf_weight * conf
    per_slot = sums["accept"] / sums["slots"].clamp(min=1)
    tau = sums["tau"] / sums["blocks"] if sums["blocks"] > 0 else torch.tensor(1.0)
    metrics = {"loss": loss.item(), "ce": ce.item(), "l1": l1.item(), "conf": conf.item(),
               "tau": float(tau), "accept": [round(x, 4) for x in per_slot.tolist()]}
    return loss, metrics


def dspark_loss(draft_logits, target_logits, labels, conf_logits, eval_mask, cfg: TrainConfig):
    """The DSpark objective (docs/dspark-algorithm.md §6.3, §11 item 8): full L1 (not halved), decay exp(-(k-1)/gamma_w),
    weighted means, soft confidence label detached, softmaxes in float32. Returns (loss, metrics)."""
    return finish_loss(loss_sums(draft_logits, target_logits.float().softmax(dim=-1), labels, conf_logits, eval_mask, cfg), cfg)


# ---- target side ------------------------------------------------------------------------------
@torch.no_grad()
def capture(target, sequences: list[torch.Tensor], tap_layers: tuple[int, ...]):
    """Online capture of the target's logits [B, S, V] at every position and taps
    {layer: [B, S, d]}, in chunks of at most max_slots sequences. Prefill returns only the last
    position's logits, so each chunk is a verify on free slots (an empty prefix, nothing
    committed), which returns every position's."""
    logits, taps = [], {layer: [] for layer in tap_layers}
    width = max(s.shape[0] for s in sequences)
    for start in range(0, len(sequences), target.max_slots):
        chunk = sequences[start : start + target.max_slots]
        slots = list(range(len(chunk)))
        lengths = [s.shape[0] for s in chunk]
        tokens = _pad(chunk).to(target.device)
        target.release(slots)
        try:
            out = target.verify(slots, tokens, lengths, tap_layers)
        finally:
            target.release(slots)
        pad = width - out.logits.shape[1]
        logits.append(F.pad(out.logits, (0, 0, 0, pad)))
        for layer in tap_layers:
            taps[layer].append(F.pad(out.taps[layer], (0, 0, 0, pad)))
    return torch.cat(logits), {layer: torch.cat(t) for layer, t in taps.items()}


@torch.no_grad()
def generate_sequences(target, prompts: list[torch.Tensor], max_new_tokens: int, temperature: float | list[float] = 1.0,
                       generator: torch.Generator | None = None, *,
                       eos_token_ids: tuple[int, ...] | None = None,
                       admit_per_step: int | None = None, progress: bool = False) -> list[torch.Tensor]:
    """Prompt + target-generated continuation for each prompt (docs/dspark-algorithm.md §6.1: responses are
    regenerated by the target): plain decoding on the engine, at most max_new_tokens tokens, a
    continuation ending with the first EOS it emits (the EOS kept, nothing after it).
    temperature: one for every prompt, or a list with one per prompt.
    eos_token_ids: None = the target's own (dspark.targets.eos_ids), () = never stop early.
    admit_per_step: None = every prompt the target has a free slot for joins at once; n = at most
    n prompts join per engine step while the others decode (a prefill's logits are [prompts,
    longest prompt, vocab], so this bounds its memory on a target with many slots).
    Each request samples with its own seed drawn from `generator` (the global RNG if None).
    progress: show the finished sequences (dspark.progress).
    `response_loss_masks` gives the matching loss masks."""
    temperatures = list(temperature) if isinstance(temperature, (list, tuple)) else [temperature] * len(prompts)
    if len(temperatures) != len(prompts):
        raise ValueError(f"temperature: {len(temperatures)} temperatures for {len(prompts)} prompts")
    for i, t in enumerate(temperatures):
        if t < 0:
            raise ValueError(f"temperature[{i}]={t!r}: must be >= 0")
    if admit_per_step is not None and admit_per_step < 1:
        raise ValueError(f"admit_per_step={admit_per_step!r}: must be >= 1 (or None)")
    eos_token_ids = eos_ids(target) if eos_token_ids is None else eos_token_ids
    seeds = torch.randint(0, 2**62, (len(prompts),), generator=generator).tolist()
    engine = Engine(target, eos_token_ids=eos_token_ids)
    responses: dict[int, list[int]] = {}  # request id -> tokens, in prompt order
    joined, running = 0, 0
    bar = progress_display(len(prompts), desc="generate data", unit="seq", disable=not progress)
    # Requests join only while a slot is free for them, so each one is prefilled in the step right
    # after it joins and no more than admit_per_step are prefilled together.
    while joined < len(prompts) or engine.has_unfinished():
        room = min(target.max_slots - running, len(prompts) - joined, admit_per_step or len(prompts))
        for i in range(joined, joined + room):
            params = SamplingParams(temperature=temperatures[i], max_tokens=max_new_tokens, seed=seeds[i])
            try:
                responses[engine.add_request(prompts[i].cpu(), params)] = []
            except ValueError as error:
                raise ValueError(f"generate_sequences: prompts[{i}]: {error}") from None
        joined, running = joined + room, running + room
        for event in engine.step():
            responses[event.request_id] += event.new_token_ids
            running -= event.finished
            bar.update(event.finished)
    bar.close()
    return [torch.cat([p.cpu(), torch.tensor(r, dtype=torch.long)]) for p, r in zip(prompts, responses.values())]


def response_loss_masks(prompts: list[torch.Tensor], sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Loss masks of generate_sequences' output: 0 over the prompt, 1 over the response (its EOS
    included); a sequence holds nothing past its response, and padding to a batch adds zeros."""
    if len(prompts) != len(sequences):
        raise ValueError(f"sequences: {len(sequences)} for {len(prompts)} prompts")
    masks = []
    for i, (p, s) in enumerate(zip(prompts, sequences)):
        if s.shape[0] < p.shape[0] or not torch.equal(s[: p.shape[0]].cpu(), p.cpu()):
            raise ValueError(f"sequences[{i}] does not start with prompts[{i}]")
        masks.append(torch.cat([torch.zeros(p.shape[0], dtype=torch.long), torch.ones(s.shape[0] - p.shape[0], dtype=torch.long)]))
    return masks


# ---- the loop ---------------------------------------------------------------------------------
def _pad(sequences: list[torch.Tensor], value: int = 0) -> torch.Tensor:
    width = max(s.shape[0] for s in sequences)
    return torch.stack([F.pad(s, (0, width - s.shape[0]), value=value) for s in sequences])


def train_step_loss(model: DSparkModel, captured, sequences, loss_masks, cfg: TrainConfig, generator):
    """Loss and metrics of one batch (forward only); `captured` = capture(target, sequences, taps)."""
    c = model.config
    device = model.context_proj.weight.device
    target_logits, taps = captured
    tokens = _pad(sequences)
    lengths = torch.tensor([s.shape[0] for s in sequences])
    mask = _pad(loss_masks)
    anchors, keep = sample_anchors(mask, lengths, cfg.num_anchors, generator)
    block, positions, labels, prev, eval_mask = build_blocks(tokens, lengths, mask, anchors, keep,
                                                             c.block_size, c.mask_token_id)
    block, positions, labels, prev, eval_mask, anchors = (t.to(device) for t in (block, positions, labels, prev, eval_mask, anchors))
    S = tokens.shape[1]
    fused = model.fuse_taps({layer: t.to(device) for layer, t in taps.items()})
    context_rows = model.context_rows(fused, torch.arange(S, device=device).expand(len(sequences), S))
    visible = torch.arange(S, device=device) < anchors[..., None]  # context strictly before the anchor
    # p_t once per position: a position is slot k of up to G blocks, and chunks are recomputed in backward.
    target_probs = target_logits.to(device).float().softmax(dim=-1)

    def blocks_sums(start: int, stop: int, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        part = slice(start, stop)
        hidden = model.backbone(block[:, part], positions[:, part], list(rows), visible[:, part])
        draft_logits, conf_logits = model.head_outputs(hidden, prev[:, part])  # teacher-forced heads
        # p_t for slot k comes from the target logits after position a+k-1 (which predict tok[a+k]):
        # row b * S + position of the flattened [B * S, V] softmax.
        index = positions[:, part].clamp(max=S - 1)
        target_rows = index + S * torch.arange(index.shape[0], device=index.device)[:, None, None]
        sums = loss_sums(draft_logits, target_probs.view(-1, target_probs.shape[-1]), labels[:, part], conf_logits,
                         eval_mask[:, part], cfg, target_rows=target_rows)
        return tuple(sums[key] for key in _SUM_KEYS)

    num_blocks = block.shape[1]
    chunk = cfg.anchor_chunk or num_blocks
    totals = None
    for start in range(0, num_blocks, chunk):
        args = (start, min(start + chunk, num_blocks), *context_rows)
        # With recompute, chunks recompute their activations in backward: memory ~ one chunk of
        # [A, G, V] logits instead of all anchors at once (docs/dspark-algorithm.md §6.2 uses 512
        # anchors). Without it, chunks only bound the attention's masked block rows (model.py).
        recomputed = cfg.recompute and chunk < num_blocks
        part = checkpoint(blocks_sums, *args, use_reentrant=False) if recomputed else blocks_sums(*args)
        totals = part if totals is None else tuple(t + p for t, p in zip(totals, part))
    return finish_loss(dict(zip(_SUM_KEYS, totals)), cfg)


_SUM_KEYS = ("ce", "l1", "conf", "weight", "accept", "slots", "tau", "blocks")


def _cached_capture(cache: dict, pick: list[int], target, sequences, tap_layers):
    """capture() of sequences[pick], prefilling only the ones not seen before."""
    missing = [i for i in pick if i not in cache]
    if missing:
        logits, taps = capture(target, [sequences[i] for i in missing], tap_layers)
        for row, i in enumerate(missing):
            n = sequences[i].shape[0]
            cache[i] = (logits[row, :n].clone(), {layer: t[row, :n].clone() for layer, t in taps.items()})
    width = max(sequences[i].shape[0] for i in pick)
    logits = torch.stack([F.pad(cache[i][0], (0, 0, 0, width - cache[i][0].shape[0])) for i in pick])
    taps = {layer: torch.stack([F.pad(cache[i][1][layer], (0, 0, 0, width - cache[i][1][layer].shape[0])) for i in pick])
            for layer in tap_layers}
    return logits, taps


def epoch_batches(supervised: list[int], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """The batches of one epoch (indices into the sequences), from (seed, epoch) alone.

    A batch runs as many blocks per sequence as its longest supervised span has anchors, so
    shorter sequences carry padding blocks. With length_groups = n, the shuffled sequences are
    cut into groups of n batches, each group sorted by supervised length before it is split into
    batches (the batch order within a group is shuffled too): every batch holds sequences of
    similar length, and a sequence still appears once per epoch."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
    order = torch.randperm(len(supervised), generator=gen).tolist()
    usable = len(order) // cfg.batch_size * cfg.batch_size or len(order)
    order = order[:usable]
    if cfg.length_groups:
        span = cfg.length_groups * cfg.batch_size
        grouped = []
        for start in range(0, len(order), span):
            group = sorted(order[start : start + span], key=lambda i: supervised[i])
            batches = [group[j : j + cfg.batch_size] for j in range(0, len(group), cfg.batch_size)]
            grouped += [batches[j] for j in torch.randperm(len(batches), generator=gen).tolist()]
        return grouped
    return [order[j : j + cfg.batch_size] for j in range(0, len(order), cfg.batch_size)]


LOG_FILE = "train_log.jsonl"


def _drop_log_lines_after(path: Path, step: int) -> None:
    """Keep the loss log's lines up to `step` (a resumed run writes the later ones again)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.strip() or json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        write_atomic(path, "".join(kept))


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    warmup = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, cfg.steps - warmup)))


class Trainer:
    """One drafter's training state: AdamW with the warm-up + cosine schedule, the data order, the
    checkpoints and the loss log. `train` and `train_together` drive it a step at a time.

    With out_dir, checkpoints go to out_dir (every save_every steps and when a run stops) and the
    loss log to out_dir/train_log.jsonl; resume=True continues from out_dir's trainer state.
    Data order and anchors depend only on (seed, step), so a resumed run equals an unbroken one.
    """

    def __init__(self, model: DSparkModel, sequences: list[torch.Tensor], loss_masks: list[torch.Tensor] | None,
                 config: TrainConfig, out_dir: str | Path | None = None, resume: bool = False):
        cfg = self.config = config.validate()
        if loss_masks is None:
            loss_masks = [torch.ones_like(s) for s in sequences]
        if len(loss_masks) != len(sequences):
            raise ValueError(f"loss_masks: {len(loss_masks)} masks for {len(sequences)} sequences")
        for i, (m, s) in enumerate(zip(loss_masks, sequences)):
            if m.shape != s.shape:  # a mask longer than its sequence would supervise positions past its end
                raise ValueError(f"loss_masks[{i}] has shape {tuple(m.shape)}: sequences[{i}] has {tuple(s.shape)}")
        usable = [i for i, s in enumerate(sequences) if s.shape[0] >= 2]
        self.sequences, self.loss_masks = [sequences[i] for i in usable], [loss_masks[i] for i in usable]
        if not self.sequences:
            raise ValueError("sequences: none has the 2 tokens an anchor needs")
        self.model, self.out_dir = model, Path(out_dir) if out_dir is not None else None
        model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: _lr_factor(s, cfg))
        self.step = 0
        if resume:
            if self.out_dir is None:
                raise ValueError("resume=True: needs out_dir")
            state = load_trainer_state(self.out_dir)
            if state is None:
                raise ValueError(f"resume=True: no trainer state in {str(self.out_dir)!r}")
            load_weights(model, read_tensors(self.out_dir))
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step = state["step"]
            _drop_log_lines_after(self.out_dir / LOG_FILE, self.step)  # steps a kill cut off before their save
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.out_dir / LOG_FILE, "a") if self.out_dir is not None else None
        self._supervised = [int(m.sum()) for m in self.loss_masks]
        self._batches = (0, epoch_batches(self._supervised, cfg, 0))  # (epoch, its batches)

    def batch(self) -> list[int]:
        """The indices (into self.sequences) of this step's batch."""
        epoch, offset = divmod(self.step, len(self._batches[1]))
        if self._batches[0] != epoch:
            self._batches = (epoch, epoch_batches(self._supervised, self.config, epoch))
        return self._batches[1][offset]

    def run_step(self, captured, pick: list[int]) -> dict:
        """One optimizer step on batch `pick` given its capture; returns its metrics."""
        cfg = self.config
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 7919 * (self.step + 1))
        loss, metrics = train_step_loss(self.model, captured, [self.sequences[i] for i in pick],
                                        [self.loss_masks[i] for i in pick], cfg, generator)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        metrics["step"] = self.step
        if self._log is not None:
            self._log.write(json.dumps(metrics) + "\n")
            self._log.flush()
        return metrics

    def save(self, stopping: bool) -> bool:
        """A checkpoint, when the run stops here or at every save_every steps; whether it wrote one.
        The files are written into a temporary folder beside them and then renamed over the last
        checkpoint's, so a kill while saving leaves that checkpoint whole."""
        if self.out_dir is None or not (stopping or (self.config.save_every and self.step % self.config.save_every == 0)):
            return False
        staging = Path(tempfile.mkdtemp(dir=self.out_dir, prefix=".saving-"))
        try:
            save_checkpoint(self.model, staging, trainer_state={
                "step": self.step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "train_config": asdict(self.config)})
            for written in sorted(staging.iterdir(), key=lambda f: f.name == TRAINER_STATE_FILE):  # the state last
                written.chmod(file_mode())  # safetensors writes 0600
                os.replace(written, self.out_dir / written.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return True

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
        self.model.eval()


def train(
    target,
    model: DSparkModel,
    sequences: list[torch.Tensor],
    *,
    loss_masks: list[torch.Tensor] | None = None,
    config: TrainConfig = TrainConfig(),
    out_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    deadline: float | None = None,
    cache_captures: bool = False,
    stop: Callable[[], bool] | None = None,
) -> list[dict]:
    """Train `model` in place for config.steps steps (Trainer: checkpoints, log, resume); returns
    the per-step metrics.

    stop_after ends this call after that many steps, and deadline (a time.time() value) after
    the first step that ends past it, each saving a checkpoint to resume from, for runs split
    across time-limited jobs. cache_captures keeps each sequence's target logits and
    taps in memory after its first prefill (an offline target cache for small data sets and
    slow targets; memory = sum of S x (V + taps x d) floats). stop() is asked after each step;
    True ends the run there with a checkpoint (a Ctrl-C the caller caught).
    """
    trainer = Trainer(model, sequences, loss_masks, config, out_dir, resume)
    try:
        return train_together(target, {"drafter": trainer}, progress=progress, stop_after=stop_after,
                              deadline=deadline, cache_captures=cache_captures, stop=stop)["drafter"]
    finally:
        trainer.close()


def train_together(
    target,
    trainers: dict[str, Trainer],
    *,
    progress: bool = True,
    stop_after: int | None = None,
    deadline: float | None = None,
    cache_captures: bool = False,
    stop: Callable[[], bool] | None = None,
) -> dict[str, list[dict]]:
    """train() for several drafters on the same batches, in lockstep: each step's batch is
    prefilled into the target once (the union of their tap layers) and every drafter trains on
    that capture. The trainers must stand at the same step over the same data with the same
    batch order (seed, batch size, length groups); their own losses and schedules may differ.
    stop_after, deadline, cache_captures and stop as in train(). Returns each trainer's per-step
    metrics; the caller closes the trainers."""
    first = next(iter(trainers.values()))

    def order(t: Trainer) -> tuple:
        return t.step, t.config.seed, t.config.batch_size, t.config.length_groups, t.config.steps, len(t.sequences)

    for name, t in trainers.items():
        if order(t) != order(first):
            raise ValueError(f"train_together: trainer {name!r} (step, seed, batch_size, length_groups, steps, "
                             f"sequences) = {order(t)} differs from {order(first)}: lockstep needs the same batches")
    taps = tuple(sorted({layer for t in trainers.values() for layer in t.model.config.target_layer_ids}))
    history: dict[str, list[dict]] = {name: [] for name in trainers}
    cache: dict[int, tuple] | None = {} if cache_captures else None
    last_step = first.config.steps if stop_after is None else min(first.config.steps, first.step + stop_after)
    bar = progress_display(first.config.steps, initial=first.step, desc="train", unit="step", disable=not progress)
    while first.step < last_step:
        pick = first.batch()
        captured = _cached_capture(cache, pick, target, first.sequences, taps) if cache is not None \
            else capture(target, [first.sequences[i] for i in pick], taps)
        for name, t in trainers.items():
            if t.batch() != pick:  # same configs and data give the same batches; this guards a mix-up
                raise ValueError(f"train_together: trainer {name!r} draws another batch at step {t.step}")
            history[name].append(t.run_step(captured, pick))  # its taps: fuse_taps picks its own layers
        bar.update(1)
        bar.set_postfix({name: f"loss {h[-1]['loss']:.4f} tau {h[-1]['tau']:.2f}" for name, h in history.items()})
        stopping = (first.step == last_step or (deadline is not None and time.time() > deadline)
                    or (stop is not None and stop()))
        for name, t in trainers.items():
            if t.save(stopping) and progress:
                bar.write(f"checkpoint: {name} at step {t.step} saved to {t.out_dir}")
        if stopping:
            break
    bar.close()
    return history


def read_jsonl_sequences(path: str | Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Training data: one JSON object per line with "tokens" (or "input_ids") and an optional
    "loss_mask" (1 = supervised, e.g. assistant tokens)."""
    sequences, masks = [], []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        ids = row.get("tokens", row.get("input_ids"))
        if ids is None:
            raise ValueError(f"{path}:{number}: needs a 'tokens' or 'input_ids' list")
        mask = row.get("loss_mask", [1] * len(ids))
        if len(mask) != len(ids):
            raise ValueError(f"{path}:{number}: loss_mask has {len(mask)} entries for {len(ids)} tokens")
        sequences.append(torch.tensor(ids, dtype=torch.long))
        masks.append(torch.tensor(mask, dtype=torch.long))
    return sequences, masks
