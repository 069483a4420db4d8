"""`dspark vllm-config`: print the JSON for `vllm serve --speculative-config` built from dspark's
flags, and validate it with the installed vLLM when there is one.

stdout carries the JSON and nothing else, so `"$(dspark vllm-config ...)"` can feed `vllm serve`;
on any error stdout stays empty and the exit status is 2 (see the README's recipe, which stops there).
"""
from __future__ import annotations

import argparse
import json
import sys

from dspark.commands.spec_args import add_spec_arguments, spec_from_args

from .convert import check_extra_fields, convert, drafter_config_file, is_hub_id
from .validate import validate_with_vllm, vllm_importable
from .versions import format_version, minimum_vllm_version


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags for `dspark vllm-config` (SpecConfig fields, same names as vLLM where vLLM has them)."""
    parser.description = ("Print the JSON for `vllm serve --speculative-config` (or LLM(speculative_config=...)) "
                          "built from a dspark SpecConfig, and validate it with the installed vLLM when there is one.")
    add_spec_arguments(parser)
    parser.add_argument("--block-size", type=int, default=None,
                        help="the drafter's trained block size, when its config.json is not at hand")
    parser.add_argument("--drafter-in-target", action="store_true",
                        help="--drafter dspark without --drafter-path: the target checkpoint ships its drafter "
                             "(DeepSeek-V4); refused otherwise")
    parser.add_argument("--extra", type=_json_object, default=None,
                        help="JSON object of vLLM SpeculativeConfig fields dspark has no flag for, passed as they are "
                             "and validated by the installed vLLM, e.g. "
                             "'{\"draft_tensor_parallel_size\": 1, \"max_model_len\": 32768}'")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (vllm serve --seed)")
    parser.add_argument("--target-model", default=None,
                        help="local target model directory for validation (default: a tiny generated one)")
    parser.add_argument("--no-validate", action="store_true", help="do not validate with the installed vLLM")
    return parser


def _validating_vllm(args: argparse.Namespace) -> str | None:
    """The version of the vLLM that will validate the config, None when none will."""
    if args.no_validate or not vllm_importable():
        return None
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on the path: vLLM tells its version
        import vllm

        return vllm.__version__


def _why_not_validated(args: argparse.Namespace, config: dict) -> str | None:
    if args.no_validate:
        return "--no-validate"
    if not vllm_importable():
        return "vllm is not importable in this environment"
    model = config.get("model")
    if model is not None and is_hub_id(model):
        try:
            drafter_config_file(model)  # vLLM needs the drafter's config.json to check it
        except ValueError as exc:
            return str(exc)
    return None


def main(args: argparse.Namespace) -> int:
    """Print the speculative_config JSON on stdout; notes and validation status on stderr.
    Exit status 0 when valid, 2 when the config is rejected (by us or by vLLM)."""
    try:
        check_extra_fields(args.extra, _validating_vllm(args))
        spec, block = spec_from_args(args, seed=args.seed)
        result = convert(spec, block_size=args.block_size, block_verification=block,
                         drafter_in_target=args.drafter_in_target, extra=args.extra)
    except ValueError as exc:
        print(f"dspark vllm-config: error: {exc}", file=sys.stderr)
        return 2
    print(f"needs vLLM >= {format_version(minimum_vllm_version(result.config))}; "
          f"engine arguments: {json.dumps(result.engine_args)} (vllm serve --seed {spec.seed})", file=sys.stderr)
    for note in result.not_carried:
        print(f"not carried over to vLLM: {note}", file=sys.stderr)
    for note in result.warnings:
        print(f"warning: {note}", file=sys.stderr)
    for name in result.passed_through:
        print(f"passed through to vLLM, its value unchecked by dspark: {name}={json.dumps(result.config[name])}",
              file=sys.stderr)
    why_not = _why_not_validated(args, result.config)
    if why_not:
        print(f"not validated: {why_not}", file=sys.stderr)
        print(json.dumps(result.config))
        return 0
    try:
        checked = validate_with_vllm(result.config, target_model=args.target_model,
                                     passed_through=result.passed_through)
    except ValueError as exc:
        print(f"dspark vllm-config: error: {exc}", file=sys.stderr)
        return 2
    what = "SpeculativeConfig and VllmConfig accept it" if checked.vllm_config_built else "SpeculativeConfig accepts it"
    print(f"validated with vLLM {checked.vllm_version}: {what} "
          f"(method={checked.method}, num_speculative_tokens={checked.num_speculative_tokens})", file=sys.stderr)
    if checked.draft_architectures:
        print(f"vLLM resolved the draft model's architecture to {list(checked.draft_architectures)}", file=sys.stderr)
    for note in (checked.vllm_config_skipped, *checked.notes):
        if note:
            print(note, file=sys.stderr)
    print(json.dumps(result.config))
    return 0
