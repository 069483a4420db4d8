"""The speculative-decoding flags, one set for every command that builds a SpecConfig
(`dspark generate`, `dspark vllm-config`), and the one SpecConfig they describe.

Flag names are SpecConfig's field names (vLLM's where vLLM has the same notion). Every flag
defaults to None so that `--speculative-config` (a vLLM speculative_config JSON, read back by
dspark.vllm.convert.from_vllm_config) can refuse being mixed with them; unset fields take
SpecConfig's defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from ..config import Profile, SpecConfig

# flag dest -> SpecConfig field it sets (the batch-1 k and "block" are handled on their own).
_SPEC_FIELDS = (
    "num_speculative_tokens", "drafter", "drafter_path", "prompt_lookup_min", "prompt_lookup_max",
    "draft_sample_method", "rejection_sample_method", "synthetic_acceptance_length", "synthetic_acceptance_rates",
    "verify_policy", "confidence_threshold", "sps_table_path", "num_speculative_tokens_per_batch_size",
    "max_speculative_seq_len",
)


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _gates(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        entries = json.loads(text)
        return tuple(tuple(int(x) for x in entry) for entry in entries)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON like [[1, 4, 7], [5, 64, 3]]") from None


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    d = SpecConfig()
    p.add_argument("-k", "--k", "--num-speculative-tokens", dest="num_speculative_tokens", type=int, default=None,
                   help=f"drafts per step; 0 = plain decoding (default {d.num_speculative_tokens})")
    p.add_argument("--drafter", choices=("ngram", "dspark"), default=None, help=f"default {d.drafter}")
    p.add_argument("--drafter-path", default=None,
                   help="DSpark drafter checkpoint: a local directory or a Hugging Face hub id such as "
                        "Inferact/Kimi-K3-DSpark (vLLM `model`)")
    p.add_argument("--prompt-lookup-min", type=int, default=None, help=f"n-gram drafter (default {d.prompt_lookup_min})")
    p.add_argument("--prompt-lookup-max", type=int, default=None, help=f"n-gram drafter (default {d.prompt_lookup_max})")
    p.add_argument("--draft-sample-method", choices=("greedy", "probabilistic"), default=None,
                   help=f"default {d.draft_sample_method}")
    p.add_argument("--rejection-sample-method", choices=("standard", "synthetic", "block"), default=None,
                   help=f"default {d.rejection_sample_method}; 'block' is vLLM-only (block verification)")
    p.add_argument("--synthetic-acceptance-length", type=float, default=None)
    p.add_argument("--synthetic-acceptance-rates", type=_rates, default=None, help="e.g. 1,1,0.8,0.5")
    p.add_argument("--verify-policy", choices=("fixed", "threshold", "scheduler"), default=None,
                   help=f"default {d.verify_policy}")
    p.add_argument("--confidence-threshold", type=float, default=None, help=f"default {d.confidence_threshold}")
    p.add_argument("--sps-table-path", default=None)
    p.add_argument("--num-speculative-tokens-per-batch-size", type=_gates, default=None,
                   help="JSON [[batch_start, batch_end, k], ...]")
    p.add_argument("--max-speculative-seq-len", type=int, default=None)
    p.add_argument("--batch1-num-speculative-tokens", type=int, default=None,
                   help="k of the batch-1 profile (its other settings keep their defaults)")
    p.add_argument("--speculative-config", default=None,
                   help="a vLLM speculative_config JSON (as for `vllm serve --speculative-config`) instead of the "
                        "flags above")


def spec_from_args(args: argparse.Namespace, *, seed: int = 0) -> tuple[SpecConfig, bool]:
    """The SpecConfig and the block_verification flag the parsed flags describe (validated)."""
    given = [name for name in (*_SPEC_FIELDS, "batch1_num_speculative_tokens") if getattr(args, name) is not None]
    if args.speculative_config is not None:
        from ..vllm.convert import from_vllm_config

        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"--speculative-config and {flags}: give the settings one way, not both")
        spec, block = from_vllm_config(args.speculative_config)
        return dataclasses.replace(spec, seed=seed), block
    fields = {name: getattr(args, name) for name in _SPEC_FIELDS if getattr(args, name) is not None}
    block = fields.get("rejection_sample_method") == "block"
    if block:
        fields["rejection_sample_method"] = "standard"
    if args.batch1_num_speculative_tokens is not None:
        fields["batch1_profile"] = Profile(num_speculative_tokens=args.batch1_num_speculative_tokens)
    return SpecConfig(**fields, seed=seed).validate(), block
