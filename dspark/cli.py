"""`dspark` command line: argparse subcommands. Each subcommand lives in its own module exposing
`configure_parser(parser)` and `main(args) -> int`; only the module of the command being run is
imported and configured, so `dspark generate` never imports vLLM or a GPU toolchain."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("dspark.commands.generate", "generate tokens with (or without) speculation; prints AL and tokens/s"),
    "sweep": ("dspark.commands.sweep", "acceptance-length sweep: tokens/s, TPOT, step split vs AL, k, batch, policy"),
    "roofline": ("dspark.roofline", "bytes, FLOPs and time floors of decode and verify steps"),
    "train-drafter": ("dspark.commands.train_drafter", "train a DSpark drafter on a target's hidden states"),
    "calibrate": ("dspark.commands.calibrate", "fit per-position confidence temperatures (STS)"),
    "vllm-config": ("dspark.vllm.cli", "print a validated vLLM --speculative-config JSON"),
    "export-drafter": ("dspark.vllm.export", "write a DSpark drafter in a layout vLLM's DSpark loader reads"),
}


class OneLineErrors(argparse.ArgumentParser):
    """argparse, with its usage errors as one line (`dspark <command>: error: ...`, exit 2)
    instead of the usage block followed by the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _BothKSpellings:
    """The parser as a command's configure_parser sees it: an option declared as `-k` or `--k`
    gets the other spelling too, so every command that takes k accepts both."""

    def __init__(self, parser: argparse.ArgumentParser):
        self._parser = parser

    def add_argument(self, *flags, **kwargs):
        if "-k" in flags or "--k" in flags:
            flags = tuple(dict.fromkeys((*flags, "-k", "--k")))
        return self._parser.add_argument(*flags, **kwargs)

    def __getattr__(self, name):
        return getattr(self._parser, name)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `dspark` parser with every subcommand listed; `command`'s own options are configured
    (its module imported), the others stay empty until they are the one being run."""
    parser = OneLineErrors(prog="dspark", description="DSpark speculative decoding for Kimi K3",
                            epilog="dspark <command> --help shows a command's options.")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>", title="commands")
    for name, (module_name, text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=text, description=text)
        if name == command:
            importlib.import_module(module_name).configure_parser(_BothKSpellings(sub))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    name = argv[0]
    if not name.startswith("-") and name not in COMMANDS:
        print(f"dspark: error: unknown command {name!r} (commands: {', '.join(COMMANDS)}; see dspark --help)",
              file=sys.stderr)
        return 2
    args = build_parser(name).parse_args(argv)
    module = importlib.import_module(COMMANDS[name][0])
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
