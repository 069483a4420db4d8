"""`dspark generate`: run prompts through the engine and print tokens, AL and tokens/s."""
from __future__ import annotations

import argparse
import json
import sys

from ..build import build_engine, build_target, check_speculative_tokens
from ..config import SamplingParams
from ..progress import poll_progress
from .. import checks
from .spec_args import add_spec_arguments, spec_from_args


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="k3-tiny", help="k3 | k3-tiny | k3-slice | smollm2 | toy | checkpoint dir")
    p.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    p.add_argument("--prompt", action="append", default=[], help="text (needs a target with a tokenizer: smollm2)")
    add_spec_arguments(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated integers") from None


def main(args) -> int:
    # Every flag is checked before any model loads.
    prompts = [_parse_ids(t) for t in args.prompt_ids]
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens).validate()
    device = checks.device(args.device)
    checks.at_least("--max-seq-len", args.max_seq_len)
    if args.prompt and args.target != "smollm2":
        raise ValueError(f"--prompt needs a target with a tokenizer (smollm2), not --target {args.target}")
    spec, block = spec_from_args(args, seed=args.seed if args.seed is not None else 0)
    if block:
        raise ValueError("--rejection-sample-method block: block verification is vLLM-only; dspark's engine "
                         "verifies with 'standard' or 'synthetic'")
    check_speculative_tokens(spec, args.max_seq_len)

    tokenizer = None
    if args.prompt:
        from ..targets.llama import load_smollm2_target

        target, tokenizer = load_smollm2_target(max_slots=len(args.prompt) + len(prompts), max_seq_len=args.max_seq_len)
        prompts += [tokenizer.encode_chat([{"role": "user", "content": t}]).tolist() for t in args.prompt]
    if not prompts:
        prompts = [[1, 5, 9, 5, 9, 5]]
    if tokenizer is None:
        target = build_target(args.target, max_slots=len(prompts), max_seq_len=args.max_seq_len, device=device)
    engine = build_engine(spec, target)
    # Progress from the engine's token count, read on a timer: the loop itself stays as it is.
    with poll_progress(lambda: engine.metrics.num_output_tokens, len(prompts) * params.max_tokens,
                       desc="generate", unit="tok"):
        outputs = engine.generate(prompts, params)
    summary = engine.metrics.summary()
    if args.json:
        print(json.dumps({"outputs": [o.__dict__ for o in outputs], "metrics": summary}))
        return 0
    failed = [o for o in outputs if o.error]
    for o in failed:  # one request's bad input fails that request alone
        print(f"dspark generate: error: request {o.request_id}: {o.error}", file=sys.stderr)
    if len(failed) == len(outputs):
        return 2
    for o in outputs:
        if o.error:
            continue  # reported above
        text = f"  {tokenizer.decode(o.token_ids, skip_special_tokens=True)!r}" if tokenizer else ""
        print(f"[{o.request_id}] {o.token_ids} ({o.finish_reason}){text}")
    print(f"acceptance length {summary['acceptance_length']:.2f}  tokens/s {summary['tokens_per_s']:.1f}  "
          f"steps {summary['steps']}  (k={spec.num_speculative_tokens}, drafter={spec.drafter})")
    return 0 if all(o.error is None for o in outputs) else 1
