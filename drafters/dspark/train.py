"""Training the DSpark drafter against a target (docs/dspark-algorithm.md §6).

Each step reads the target for a batch of training sequences (online capture: a prefill with the
drafter's tap layers; or a CaptureStore that captured every sequence once), samples up to
`num_anchors` anchors per sequence, builds one block per anchor ([tok[a], MASK...] at positions
a..a+G-1, labels tok[a+1..a+G], §6.2), runs every block in one parallel pass with the Markov and
confidence heads teacher-forced on the true previous tokens, and minimises (§6.3, loss.py)

    L = 0.1 * CE + 0.9 * ||p_d - p_t||_1 + 1.0 * BCE(conf_logit, 1 - 0.5 * ||p_d - p_t||_1 (detached)),

each term a mean weighted by w_k = exp(-(k-1)/4) over supervised slots. The step runs one of two
ways (steps.py): the reference (anchor chunks, dense attention, every slot) or the fast one
(all anchors, block-sparse attention, supervised slots only, optionally compiled). AdamW with
linear warm-up then cosine decay or warmup-stable-decay (§6.6), gradient clipping; checkpoints
(safetensors + config.json + trainer_state.pt, with AdamW's moments and the schedule's position)
resume exactly; a jsonl loss log and a progress display (dspark.progress).
"""
from __future__ import annotations

import functools
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

from dspark.config import SamplingParams
from dspark.engine import Engine
from dspark.files import file_mode, write_atomic
from dspark.progress import progress as progress_display
from dspark.targets import eos_ids

from .capture import BatchCapture, CaptureStore, capture  # noqa: F401 (capture: the online path, re-exported)
from .checkpoint import TRAINER_STATE_FILE, load_trainer_state, load_weights, read_tensors, save_checkpoint
from .loss import dspark_loss, metrics_to_floats  # noqa: F401 (dspark_loss re-exported)
from .model import DSparkModel
from .steps import blocks_forward, build_blocks, fast_step_loss, make_batch, reference_step_loss, sample_anchors  # noqa: F401

SCHEDULES = ("cosine", "wsd")
TEACHERS = ("logits", "lm_head")
ATTENTIONS = ("sdpa", "flex")
# torch.compile's modes for the blocks' pass: "reduce-overhead" also replays it as CUDA graphs (its forward
# and backward), for the host's launch gap between the step's kernels (experiments/smollm2_profile.py
# times both as train_after and train_after_graphs)
COMPILE_MODES = ("default", "reduce-overhead")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    lr: float = 6e-4
    warmup_frac: float = 0.04
    # "cosine": warm-up then cosine to 0 (the released drafters'); "wsd": warm-up, the peak held,
    # then a linear decay to 0 over the last decay_frac of the steps (docs/dspark-algorithm.md §6.6).
    schedule: str = "cosine"
    decay_frac: float = 0.12
    weight_decay: float = 0.0
    num_anchors: int = 512
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    decay_gamma: float = 4.0  # all released configs use 4.0, not the block size (docs/dspark-algorithm.md §6.3)
    grad_clip: float = 1.0
    anchor_chunk: int = 0  # > 0: run the blocks this many anchors at a time (reference step)
    recompute: bool = True  # chunks recompute their activations in backward (memory ~ one chunk's)
    # > 0: batches drawn from groups of this many batches sorted by supervised length (epoch_batches)
    length_groups: int = 0
    # Where the teacher's distribution comes from: "logits", the target's own logits per position;
    # "lm_head", softmax(lm_head(the LM head's input)), tap num_layers (what a CaptureStore keeps).
    teacher: str = "logits"
    fast: bool = False  # the fast step (steps.fast_step_loss) instead of the reference
    attention: str = "sdpa"  # the fast step's attention: "sdpa" (dense mask) or "flex" (block-sparse; GPU)
    # Static shapes (fast step): anchors per sequence and padded length rounded up to these
    # multiples (0: exact), so a run's batches take a few shapes and a compiled step a few graphs.
    anchor_bucket: int = 0
    length_bucket: int = 0
    compile: bool = False  # torch.compile the fast step's forward over the blocks
    compile_mode: str = "default"  # one of COMPILE_MODES, with compile
    log_every: int = 1  # metrics read back (a wait for the device) and logged every this many steps
    seed: int = 42
    save_every: int = 0  # 0: save only at the end

    def validate(self) -> "TrainConfig":
        for name in ("steps", "batch_size", "num_anchors", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TrainConfig.{name}={v!r}: must be an integer >= 1")
        for name in ("lr", "decay_gamma", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: must be > 0")
        for name in ("warmup_frac", "decay_frac"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: must be in [0, 1)")
        for name in ("weight_decay", "ce_weight", "l1_weight", "conf_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: must be >= 0")
        if not (self.ce_weight or self.l1_weight or self.conf_weight):
            raise ValueError("TrainConfig.ce_weight, l1_weight, conf_weight: all 0; at least one must be > 0")
        for name, allowed in (("schedule", SCHEDULES), ("teacher", TEACHERS), ("attention", ATTENTIONS),
                              ("compile_mode", COMPILE_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: must be one of {allowed}")
        for name in ("anchor_chunk", "length_groups", "save_every", "anchor_bucket", "length_bucket"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"TrainConfig.{name}={v!r}: must be an integer >= 0 (0 = off)")
        for name in ("recompute", "fast", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: must be a bool")
        if not self.fast and (self.attention != "sdpa" or self.compile):
            raise ValueError(f"TrainConfig.attention={self.attention!r}, compile={self.compile!r}: "
                             "flex attention and compile are options of the fast step (fast=True)")
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"TrainConfig.compile_mode={self.compile_mode!r}: a mode of compile, which is off")
        return self


def compiled_blocks_forward(cfg: TrainConfig):
    """blocks_forward compiled as cfg asks (static shapes: each bucketed shape, docs/dspark-algorithm.md
    §6.2, gets its own graph, never a symbolic-shape one), or None when it does not."""
    if not cfg.compile:
        return None
    mode = {} if cfg.compile_mode == "default" else {"mode": cfg.compile_mode}
    return torch.compile(blocks_forward, dynamic=False, **mode)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """The schedule: the learning rate of optimizer step `step` (0-based) over cfg.lr."""
    warmup = max(1, round(cfg.warmup_frac * cfg.steps))
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "wsd":
        decay = round(cfg.decay_frac * cfg.steps)
        left = cfg.steps - step  # <= 0 only for the scheduler's step after the last
        return 1.0 if left > decay else max(left, 0) / max(decay, 1)
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, cfg.steps - warmup)))


def lr_area(steps_done: int, cfg: TrainConfig) -> float:
    """The integral of the learning rate over the first steps_done steps (sum of each step's lr):
    held-out gains track it rather than the step count (docs/dspark-algorithm.md §6.6)."""
    return cfg.lr * sum(lr_factor(s, cfg) for s in range(steps_done))


def train_step_loss(model: DSparkModel, captured, sequences, loss_masks, cfg: TrainConfig, generator, *, forward=None):
    """Loss and metrics (0-d device tensors) of one batch, forward only; `captured` is a
    BatchCapture or capture(target, sequences, taps)'s (logits, taps). The step cfg.fast picks
    (steps.py); forward: the fast step's (compiled) blocks_forward."""
    batch = make_batch(sequences, loss_masks, cfg, generator, model.config.block_size, model.config.mask_token_id)
    captured = BatchCapture.of(captured)
    if cfg.fast:
        return fast_step_loss(model, captured, batch, cfg, forward)
    return reference_step_loss(model, captured, batch, cfg)


def capture_layers(model: DSparkModel, cfg: TrainConfig) -> tuple[int, ...]:
    """What a step reads of the target: the drafter's taps, and the LM head's input for an lm_head teacher."""
    taps = tuple(model.config.target_layer_ids)
    return taps + (model.config.target_num_layers,) if cfg.teacher == "lm_head" else taps

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


class Trainer:
    """One drafter's training state: AdamW with the config's schedule, the data order, the
    checkpoints and the loss log. `train` and `train_together` drive it a step at a time.

    With out_dir, checkpoints go to out_dir (every save_every steps and when a run stops) and the
    loss log to out_dir/train_log.jsonl; resume=True continues from out_dir's trainer state: the
    weights, AdamW's moments and the schedule's position. Data order and anchors depend only on
    (seed, step), so a resumed run equals an unbroken one.
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
        cuda = model.context_proj.weight.is_cuda
        # fused: one kernel for every parameter's update on a GPU (the foreach form launches per group).
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=cuda or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, functools.partial(lr_factor, cfg=cfg))
        # One compiled pass over the blocks per trainer; train_step_loss hands it the model.
        self.forward = compiled_blocks_forward(cfg)
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
        self._unread: list[dict] = []  # metrics still on the device (flush reads them)
        self._supervised = [int(m.sum()) for m in self.loss_masks]
        self._batches = (0, epoch_batches(self._supervised, cfg, 0))  # (epoch, its batches)

    def batch(self) -> list[int]:
        """The indices (into self.sequences) of this step's batch."""
        epoch, offset = divmod(self.step, len(self._batches[1]))
        if self._batches[0] != epoch:
            self._batches = (epoch, epoch_batches(self._supervised, self.config, epoch))
        return self._batches[1][offset]

    def run_step(self, captured, pick: list[int]) -> dict:
        """One optimizer step on batch `pick` given its capture; returns its metrics, device
        tensors until `flush` reads them (in place)."""
        cfg = self.config
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 7919 * (self.step + 1))
        loss, metrics = train_step_loss(self.model, captured, [self.sequences[i] for i in pick],
                                        [self.loss_masks[i] for i in pick], cfg, generator, forward=self.forward)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip).detach()
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        metrics["step"] = self.step
        self._unread.append(metrics)
        if self.step % cfg.log_every == 0:
            self.flush()
        return metrics

    def flush(self) -> None:
        """Read back the metrics of the steps since the last flush and log them."""
        for metrics in self._unread:
            metrics.update(metrics_to_floats(metrics))
            if self._log is not None:
                self._log.write(json.dumps(metrics) + "\n")
        if self._log is not None:
            self._log.flush()
        self._unread.clear()

    def save(self, stopping: bool) -> bool:
        """A checkpoint, when the run stops here or at every save_every steps; whether it wrote one.
        The files are written into a temporary folder beside them and then renamed over the last
        checkpoint's, so a kill while saving leaves that checkpoint whole."""
        if self.out_dir is None or not (stopping or (self.config.save_every and self.step % self.config.save_every == 0)):
            return False
        self.flush()
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
        self.flush()
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
    store: CaptureStore | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[dict]:
    """Train `model` in place for config.steps steps (Trainer: checkpoints, log, resume); returns
    the per-step metrics.

    stop_after ends this call after that many steps, and deadline (a time.time() value) after
    the first step that ends past it, each saving a checkpoint to resume from, for runs split
    across time-limited jobs. store: a filled CaptureStore of `sequences` (what a step reads of
    the target, captured once); cache_captures builds one in float32 on the target's device
    (memory = sum of S x taps x d floats, plus S x V with a logits teacher). stop() is asked after
    each step; True ends the run there with a checkpoint (a Ctrl-C the caller caught).
    """
    trainer = Trainer(model, sequences, loss_masks, config, out_dir, resume)
    try:
        return train_together(target, {"drafter": trainer}, progress=progress, stop_after=stop_after,
                              deadline=deadline, cache_captures=cache_captures, store=store,
                              stop=stop)["drafter"]
    finally:
        trainer.close()


def trainer_store(target, trainers: dict[str, "Trainer"], dtype: torch.dtype = torch.float32, **kwargs) -> CaptureStore:
    """A filled CaptureStore of the trainers' sequences with every layer any of them reads."""
    first = next(iter(trainers.values()))
    layers = tuple(sorted({layer for t in trainers.values() for layer in capture_layers(t.model, t.config)}))
    logits = any(t.config.teacher == "logits" for t in trainers.values())
    store = CaptureStore(target, first.sequences, layers, logits=logits, dtype=dtype, **kwargs)
    store.fill(progress=False)
    return store


def train_together(
    target,
    trainers: dict[str, Trainer],
    *,
    progress: bool = True,
    stop_after: int | None = None,
    deadline: float | None = None,
    cache_captures: bool = False,
    store: CaptureStore | None = None,
    stop: Callable[[], bool] | None = None,
) -> dict[str, list[dict]]:
    """train() for several drafters on the same batches, in lockstep: each step's batch is
    captured once (the union of what they read of the target) and every drafter trains on that
    capture. The trainers must stand at the same step over the same data with the same batch
    order (seed, batch size, length groups); their own losses and schedules may differ.
    stop_after, deadline, cache_captures, store and stop as in train(). Returns each trainer's per-step
    metrics (read back); the caller closes the trainers."""
    first = next(iter(trainers.values()))

    def order(t: Trainer) -> tuple:
        return t.step, t.config.seed, t.config.batch_size, t.config.length_groups, t.config.steps, len(t.sequences)

    for name, t in trainers.items():
        if order(t) != order(first):
            raise ValueError(f"train_together: trainer {name!r} (step, seed, batch_size, length_groups, steps, "
                             f"sequences) = {order(t)} differs from {order(first)}: lockstep needs the same batches")
    if store is not None and len(store.sequences) != len(first.sequences):
        raise ValueError(f"store: holds {len(store.sequences)} sequences, the trainers train on {len(first.sequences)}")
    if store is None and cache_captures:
        store = trainer_store(target, trainers)
    layers = tuple(sorted({layer for t in trainers.values() for layer in capture_layers(t.model, t.config)}))
    history: dict[str, list[dict]] = {name: [] for name in trainers}
    last_step = first.config.steps if stop_after is None else min(first.config.steps, first.step + stop_after)
    bar = progress_display(first.config.steps, initial=first.step, desc="train", unit="step", disable=not progress)
    # Online, a batch is captured with logits only for a trainer whose teacher reads them.
    logits = any(t.config.teacher == "logits" for t in trainers.values())
    while first.step < last_step:
        pick = first.batch()
        captured = (store.batch(pick) if store is not None
                    else capture(target, [first.sequences[i] for i in pick], layers, logits=logits))
        for name, t in trainers.items():
            if t.batch() != pick:  # same configs and data give the same batches; this guards a mix-up
                raise ValueError(f"train_together: trainer {name!r} draws another batch at step {t.step}")
            history[name].append(t.run_step(captured, pick))  # its taps: each model picks its own layers
        bar.update(1)
        stopping = (first.step == last_step or (deadline is not None and time.time() > deadline)
                    or (stop is not None and stop()))
        if first.step % first.config.log_every == 0 or stopping:
            for t in trainers.values():
                t.flush()
            bar.set_postfix({name: f"loss {h[-1]['loss']:.4f}" + ("" if h[-1]["tau"] is None else f" tau {h[-1]['tau']:.2f}")
                             for name, h in history.items()})
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
