"""`dspark train-drafter`: train a DSpark drafter on a target's hidden states (the library is
dspark.drafters.dspark.train).

Every flag is checked before any work. The run then shows progress in each phase (data
generation, training, checkpoints) and saves a checkpoint into --out every --save-every steps and
when it stops: Ctrl-C or SIGTERM ends it after the current step with a checkpoint, so a kill loses
at most the steps since the last save, and `--resume` continues from there. The generated data and
the flags are kept in --out beside the checkpoint: a resumed run trains on the same sequences
without generating them again, and refuses flags that differ from the run it continues.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from pathlib import Path

import torch

from ..files import write_atomic
from .. import checks

# Checkpoint interval of the command (the library's TrainConfig saves only at the end by default).
SAVE_EVERY = 50
DATA_FILE = "train_data.jsonl"  # the generated sequences, for a resumed or restarted run
FLAGS_FILE = "train_flags.json"  # the flags of the run that --out holds
# Flags that do not change the trained weights: a resumed run may give them differently.
_FREE_FLAGS = ("resume", "no_progress", "device", "save_every", "command")
# Flags the generated data depends on.
_DATA_FLAGS = ("target", "seed", "num_prompts", "prompt_len", "gen_len", "gen_temperature", "max_seq_len", "data")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    from ..drafters.dspark.train import TrainConfig

    parser.add_argument("--target", required=True, help="target name for dspark.build.build_target (e.g. k3-tiny)")
    parser.add_argument("--drafter", required=True,
                        help="drafter preset name (e.g. k3-tiny_dspark, k3_dspark) or a checkpoint directory to start from")
    parser.add_argument("--out", required=True,
                        help="checkpoint directory (config.json, model.safetensors, trainer_state.pt, train_log.jsonl)")
    parser.add_argument("--data", default=None, help="jsonl with 'tokens' and optional 'loss_mask' per line")
    parser.add_argument("--num-prompts", type=int, default=256, help="without --data: random prompts the target continues")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--gen-len", type=int, default=112)
    parser.add_argument("--gen-temperature", type=float, default=1.0)
    defaults = TrainConfig()
    for name in ("steps", "batch_size", "num_anchors", "anchor_chunk", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    parser.add_argument("--save-every", type=int, default=SAVE_EVERY,
                        help=f"checkpoint every this many steps (default {SAVE_EVERY}; 0: only when the run stops)")
    for name in ("lr", "warmup_frac", "weight_decay", "grad_clip", "decay_gamma"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    parser.add_argument("--no-recompute", dest="recompute", action="store_false",
                        help="anchor chunks keep their activations for backward (faster, more memory)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="the target's context (default: 4096, or a K3 preset's own limit when smaller)")
    parser.add_argument("--no-progress", action="store_true")


def _train_config(args):
    from ..drafters.dspark.train import TrainConfig

    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_frac=args.warmup_frac,
                         weight_decay=args.weight_decay, num_anchors=args.num_anchors, decay_gamma=args.decay_gamma,
                         grad_clip=args.grad_clip, anchor_chunk=args.anchor_chunk, recompute=args.recompute,
                         seed=args.seed, save_every=args.save_every)
    try:
        return config.validate()
    except ValueError as e:  # "TrainConfig.batch_size=0: why" as the flag the user typed: "--batch-size 0: why"
        named = re.match(r"TrainConfig\.(\w+)=(.*?): (.*)", str(e))
        if named is None:
            raise
        name, value, why = named.groups()
        raise ValueError(f"--{name.replace('_', '-')} {value}: {why}") from None


def _flags(args) -> dict:
    return {name: value for name, value in sorted(vars(args).items()) if name not in _FREE_FLAGS}


def _check_out(args, out: Path) -> None:
    """--out against --resume: a checkpoint is continued only on request, and only with the flags
    it was trained with; --resume needs one."""
    from ..drafters.dspark.checkpoint import TRAINER_STATE_FILE

    has_state = (out / TRAINER_STATE_FILE).is_file()
    if args.resume and not has_state:
        raise ValueError(f"--resume: {str(out)!r} holds no checkpoint to resume ({TRAINER_STATE_FILE}); "
                         "run without --resume to start")
    if not args.resume and has_state:
        raise ValueError(f"--out {str(out)!r} holds a checkpoint: pass --resume to continue it, or give another --out")
    if args.resume and (out / FLAGS_FILE).is_file():
        before = json.loads((out / FLAGS_FILE).read_text())
        for name, value in _flags(args).items():
            if name in before and before[name] != value:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"--resume: {flag} {value} differs from the run in {str(out)!r} ({flag} "
                                 f"{before[name]}); resume with the flags it was started with")


def _check_drafter(args) -> None:
    """--drafter is a preset or a checkpoint, and built for the target when that is a K3 preset."""
    from ..drafters.dspark.checkpoint import read_config
    from ..drafters.dspark.config import PRESETS as DRAFTER_PRESETS, get_preset
    from ..targets.kimi_k3.config import PRESETS

    if Path(args.drafter).is_dir():
        config = read_config(args.drafter)
    elif args.drafter in DRAFTER_PRESETS:
        config = get_preset(args.drafter)
    else:
        raise ValueError(f"--drafter {args.drafter!r}: neither a drafter preset ({', '.join(sorted(DRAFTER_PRESETS))}) "
                         "nor a checkpoint directory")
    target = PRESETS.get(args.target)
    if target is not None:
        mine = (config.vocab_size, config.target_hidden_size, config.target_num_layers)
        theirs = (target.vocab_size, target.hidden_size, target.num_layers)
        if mine != theirs:
            raise ValueError(f"--drafter {args.drafter}: built for vocab/hidden/layers {mine}, --target {args.target} "
                             f"has {theirs}")


def _check(args) -> tuple[str, int, object, tuple | None]:
    """Every flag, before any work: (device, max_seq_len, TrainConfig, the --data sequences)."""
    from ..targets.kimi_k3.config import PRESETS

    device = checks.device(args.device)
    config = _train_config(args)
    for flag, value, minimum in (("--num-prompts", args.num_prompts, 1), ("--prompt-len", args.prompt_len, 1),
                                 ("--gen-len", args.gen_len, 1), ("--gen-temperature", args.gen_temperature, 0),
                                 ("--max-seq-len", args.max_seq_len, 1)):
        checks.at_least(flag, value, minimum)
    from ..build import default_max_seq_len

    max_seq_len = args.max_seq_len or default_max_seq_len(args.target)
    preset = PRESETS.get(args.target)
    if preset is not None and max_seq_len > preset.max_position_embeddings:
        raise ValueError(f"--max-seq-len {max_seq_len}: --target {args.target} takes at most "
                         f"{preset.max_position_embeddings} tokens")
    data = None
    if args.data:
        data = _read_data(args.data, max_seq_len)
    elif args.prompt_len + args.gen_len > max_seq_len:
        raise ValueError(f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len}: more than the target's "
                         f"context --max-seq-len {max_seq_len}")
    _check_drafter(args)
    out = checks.writable_folder("--out", args.out)
    _check_out(args, out)
    return device, max_seq_len, config, data


def _read_data(path: str, max_seq_len: int) -> tuple[list, list]:
    from ..drafters.dspark.train import read_jsonl_sequences

    checks.readable_file("--data", path)
    try:
        sequences, masks = read_jsonl_sequences(path)
    except json.JSONDecodeError as e:
        raise ValueError(f"--data {path!r}: a line is not JSON ({e})") from None
    if not any(s.shape[0] >= 2 for s in sequences):
        raise ValueError(f"--data {path!r}: no sequence has the 2 tokens an anchor needs")
    longest = max(s.shape[0] for s in sequences)
    if longest > max_seq_len:
        raise ValueError(f"--data {path!r}: a sequence of {longest} tokens is longer than --max-seq-len {max_seq_len}")
    return sequences, masks


def _generated_data(args, target, out: Path) -> tuple[list, list]:
    """The training sequences: generated by the target (progress shown), or read back from
    --out when a run with the same data flags generated them there before."""
    from ..drafters.dspark.train import generate_sequences, read_jsonl_sequences, response_loss_masks

    saved, flags_file = out / DATA_FILE, out / FLAGS_FILE
    if saved.is_file() and flags_file.is_file():
        before = json.loads(flags_file.read_text())
        if all(before.get(name) == getattr(args, name) for name in _DATA_FLAGS):
            sequences, masks = read_jsonl_sequences(saved)
            print(f"dspark train-drafter: training on the {len(sequences)} sequences generated before in {saved}",
                  file=sys.stderr)
            return sequences, masks
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, target.vocab_size, (args.prompt_len,), generator=g) for _ in range(args.num_prompts)]
    sequences = generate_sequences(target, prompts, args.gen_len, args.gen_temperature, g, progress=not args.no_progress)
    masks = response_loss_masks(prompts, sequences)
    write_atomic(saved, "".join(json.dumps({"tokens": s.tolist(), "loss_mask": m.tolist()}) + "\n"
                                for s, m in zip(sequences, masks)))
    return sequences, masks


def build_model_for(target, drafter: str, seed: int):
    """A fresh drafter from a preset (or a checkpoint directory) around the target's embedding."""
    from ..drafters.dspark.checkpoint import load_checkpoint
    from ..drafters.dspark.config import get_preset
    from ..drafters.dspark.drafter import shared_embeddings
    from ..drafters.dspark.model import DSparkModel

    embed, lm_head = shared_embeddings(target)
    if Path(drafter).is_dir():
        model = load_checkpoint(drafter, embed, lm_head, device=target.device)
    else:
        torch.manual_seed(seed)
        model = DSparkModel(get_preset(drafter), embed, lm_head).to(target.device)
    c = model.config
    if (c.vocab_size, c.target_hidden_size, c.target_num_layers) != (target.vocab_size, target.hidden_size, target.num_layers):
        raise ValueError(f"--drafter {drafter}: built for vocab/hidden/layers "
                         f"{(c.vocab_size, c.target_hidden_size, c.target_num_layers)}, the target has "
                         f"{(target.vocab_size, target.hidden_size, target.num_layers)}")
    return model


class StopOnSignal:
    """SIGINT (Ctrl-C) and SIGTERM while installed: during training (`training` set) the first
    one asks the loop to stop after its current step, which then saves a checkpoint; a second
    one, or one at any other time, interrupts at once (KeyboardInterrupt)."""

    def __init__(self):
        self.received: int | None = None
        self.training = False

    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame) -> None:
        if not self.training or self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        print(f"dspark train-drafter: {signal.Signals(signum).name}: stopping after this step with a checkpoint "
              "(again to stop at once, without one)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopOnSignal":
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def main(args: argparse.Namespace) -> int:
    from ..build import build_target
    from ..drafters.dspark.train import train

    device, max_seq_len, config, data = _check(args)
    out = Path(args.out)
    with StopOnSignal() as stop:
        target = build_target(args.target, max_slots=args.batch_size, max_seq_len=max_seq_len, device=device,
                              seed=args.seed)
        model = build_model_for(target, args.drafter, args.seed)
        out.mkdir(parents=True, exist_ok=True)
        sequences, masks = data if data is not None else _generated_data(args, target, out)
        write_atomic(out / FLAGS_FILE, json.dumps(_flags(args), indent=1) + "\n")
        stop.training = True
        history = train(target, model, sequences, loss_masks=masks, config=config, out_dir=out, resume=args.resume,
                        progress=not args.no_progress, stop=stop.requested)
    step = history[-1]["step"] if history else None
    if stop.received is not None:
        print(f"dspark train-drafter: stopped at step {step} of {config.steps}; the checkpoint in {out} continues "
              "with the same command and --resume", file=sys.stderr)
        return 128 + stop.received
    if history:
        print(json.dumps({"final": history[-1], "out": str(out)}))
    else:
        print(f"dspark train-drafter: {out} is already trained to step {config.steps}", file=sys.stderr)
    return 0
