"""`dspark sweep`: one parser, two backends. dspark.sweep measures our engine; dspark.vllm.sweep
drives vllm.LLM. Both backends depend on dspark.sweep (the vLLM one draws with its plot), and
dspark.sweep knows nothing of vLLM: the choice of backend is made here."""
from __future__ import annotations

import argparse

from .. import sweep as dspark_sweep
from ..vllm import sweep as vllm_sweep
from .. import checks

# Flags --speculative-config can set; their defaults tell "not given" from "given".
_FOLDED = ("k", "al", "policy", "drafter_path")


def configure_parser(p: argparse.ArgumentParser) -> None:
    dspark_sweep.configure_parser(p)
    vllm_sweep.add_sweep_arguments(p)


def _defaults() -> dict:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return {name: parser.get_default(name) for name in _FOLDED}


def main(args: argparse.Namespace) -> int:
    vllm_sweep.apply_speculative_config(args, _defaults())
    dspark_sweep.parse_grid(args)  # a bad grid is refused before either backend loads anything
    if args.out is not None:
        checks.writable_folder("--out", args.out)
    if args.backend == "vllm":
        return vllm_sweep.main(args)
    for flag, value in (("--drafter-path", args.drafter_path), ("--engine-args", args.engine_args)):
        if value:
            raise ValueError(f"{flag} {value!r}: only --backend vllm uses it (the dspark backend measures with "
                             "zero-cost uniform drafts on its own engine)")
    return dspark_sweep.main(args)
