"""`dspark calibrate`: fit a DSpark drafter's per-position confidence temperatures (STS) on
held-out decoding rounds and write them into its config.json (the library is
dspark.drafters.dspark.calibrate). Every flag is checked before the target loads; the decoding
shows progress; the context defaults to the target's own limit, as train-drafter's does."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..config import SamplingParams
from ..files import write_atomic
from ..progress import progress
from .. import checks


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target name for dspark.build.build_target")
    parser.add_argument("--drafter", required=True, help="drafter checkpoint directory; its config.json gets the temperatures")
    parser.add_argument("--data", default=None, help="jsonl with 'tokens' per line: held-out prompts")
    parser.add_argument("--num-prompts", type=int, default=64, help="without --data: random prompts")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the decoding (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--draft-sample-method", choices=("greedy", "probabilistic"), default="greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-slots", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="the target's context (default: 4096, or a K3 preset's own limit when smaller)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present)")
    parser.add_argument("--report", default=None, help="also write the report JSON here")


def _prompts(args, vocab_size: int) -> list[torch.Tensor]:
    if args.data:
        from ..drafters.dspark.train import read_jsonl_sequences

        return read_jsonl_sequences(args.data)[0]
    g = torch.Generator().manual_seed(args.seed)
    return [torch.randint(0, vocab_size, (args.prompt_len,), generator=g) for _ in range(args.num_prompts)]


def _check(args):
    """Every flag before the target loads: (device, max_seq_len, sampling)."""
    from ..drafters.dspark.checkpoint import read_config

    device = checks.device(args.device)
    for flag, value in (("--num-prompts", args.num_prompts), ("--prompt-len", args.prompt_len),
                        ("--max-new-tokens", args.max_new_tokens), ("--max-slots", args.max_slots),
                        ("--max-seq-len", args.max_seq_len)):
        checks.at_least(flag, value)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p).validate()
    if args.data:
        checks.readable_file("--data", args.data)
    if not Path(args.drafter).is_dir():
        raise ValueError(f"--drafter {args.drafter!r}: not a drafter checkpoint directory")
    block = read_config(args.drafter).block_size
    from ..build import default_max_seq_len

    max_seq_len = args.max_seq_len or default_max_seq_len(args.target)
    if not args.data and args.prompt_len + block + 1 > max_seq_len:
        # run_rounds needs room for one whole block after the prompt
        raise ValueError(f"--prompt-len {args.prompt_len}: with the drafter's block of {block} tokens it leaves no "
                         f"round in --max-seq-len {max_seq_len}")
    if args.report is not None:
        checks.writable_folder("--report", Path(args.report).parent)
    return device, max_seq_len, sampling


def main(args: argparse.Namespace) -> int:
    from ..build import build_target
    from ..drafters.dspark.calibrate import calibrate
    from ..drafters.dspark.drafter import load_drafter

    device, max_seq_len, sampling = _check(args)
    target = build_target(args.target, max_slots=args.max_slots, max_seq_len=max_seq_len, device=device, seed=args.seed)
    drafter = load_drafter(args.drafter, target, draft_sample_method=args.draft_sample_method)
    prompts = _prompts(args, target.vocab_size)
    with progress(len(prompts) * args.max_new_tokens, desc="calibrate: decoding rounds", unit="tok") as bar:
        result = calibrate(target, drafter, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                           seed=args.seed, on_step=lambda step: bar.update(sum(map(len, step.emitted))))
    drafter.config.save(args.drafter)
    text = json.dumps(result, indent=2)
    if args.report:
        write_atomic(args.report, text + "\n")
    print(text)
    return 0
