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


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, with its usage errors as one line (`dspark <command>: error: ...`, exit 2)
    instead of the usage block followed by the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dspark: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = _OneLineErrors(prog=f"dspark {name}", description=text)
    module.configure_parser(parser)
    _both_k_spellings(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.main(args) or 0)
    except USER_ERRORS as e:  # bad input or a missing/unreadable file: one clear line, no traceback
        print(f"dspark {name}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dspark {name}: interrupted", file=sys.stderr)
        return 130


# What a user's input can cause: refused values, missing or unreadable files (OSError covers
# FileNotFoundError, IsADirectoryError, PermissionError). Anything else is a bug and keeps its
# traceback.
USER_ERRORS = (ValueError, OSError)


def _one_line(e: BaseException) -> str:
    """The exception's message on one line; an OSError with its file named once."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    raise SystemExit(main())
