"""`dspark` command line. Each subcommand lives in its own module exposing
`configure_parser(parser)` and `main(args) -> int`; modules are imported only when their command
runs, so `dspark generate` never imports vLLM or a GPU toolchain."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("dspark.commands.generate", "generate tokens with (or without) speculation; prints AL and tokens/s"),
    "sweep": ("dspark.commands.sweep", "acceptance-length sweep: tokens/s, TPOT, step split vs AL, k, batch, policy"),
    "roofline": ("dspark.roofline", "bytes, FLOPs and time floors of decode and verify steps"),
    "train-drafter": ("dspark.drafters.dspark.train", "train a DSpark drafter on a target's hidden states"),
    "calibrate": ("dspark.drafters.dspark.calibrate", "fit per-position confidence temperatures (STS)"),
    "vllm-config": ("dspark.vllm.cli", "print a validated vLLM --speculative-config JSON"),
    "export-drafter": ("dspark.vllm.export", "write a DSpark drafter in a layout vLLM's DSpark loader reads"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: dspark <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "dspark <command> --help shows a command's options."]
    return "\n".join(lines)


def _both_k_spellings(parser: argparse.ArgumentParser) -> None:
    """Every command that takes k accepts `-k` and `--k` alike: a command that declares one
    spelling gets the other as an alias of the same option."""
    options = parser._option_string_actions  # argparse has no public lookup of an option by its flag
    for have, alias in (("--k", "-k"), ("-k", "--k")):
        if have in options and alias not in options:
            options[have].option_strings.append(alias)
            options[alias] = options[have]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dspark: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"dspark {name}", description=text)
    module.configure_parser(parser)
    _both_k_spellings(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.main(args) or 0)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"dspark {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
