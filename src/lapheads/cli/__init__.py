"""The ``lapheads`` command: one entry point, one sub-command per job.

Every error a user can cause (a bad head spec, a bad option) ends in one line on stderr naming the bad value and
what is allowed, and a non-zero exit status; tracebacks are for bugs. The parser is declared in
:mod:`lapheads.cli.parser`, the handlers are in :mod:`lapheads.cli.commands`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from lapheads.cli.commands import UserError, one_line
from lapheads.cli.parser import TrainParser, build_parser
from lapheads.errors import LapheadsError
from lapheads.log import get_verbosity, set_verbosity

__all__ = ["UserError", "build_parser", "main"]


def _without_threads(argv: list[str]) -> list[str]:
    """The command line less ``--threads auto|N``, which every command takes and lapheads/__init__ applied before
    torch started (lapheads.hardware); ``sweep --threads`` keeps its own meaning (threads shared by its jobs)."""
    if "sweep" in argv[:1]:
        return argv
    kept, skip = [], False
    for i, item in enumerate(argv):
        if skip:
            skip = False
            continue
        if item == "--threads" and i + 1 < len(argv):
            value, skip = argv[i + 1], True
        elif item.startswith("--threads="):
            value = item.split("=", 1)[1]
        else:
            kept.append(item)
            continue
        from lapheads.cli.parser import thread_setting

        try:
            thread_setting(value)  # auto, or 1 to the CPUs this process may use
        except argparse.ArgumentTypeError as err:
            raise SystemExit(f"lapheads: error: --threads {err}") from None
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = _without_threads(list(sys.argv[1:] if argv is None else argv))
    if argv[:1] == ["train"] and {"-h", "--help"} & set(argv) and "--preset" in argv[:-1]:
        TrainParser.preset_for_help = argv[argv.index("--preset") + 1]  # help shows that preset's values
    # Options a sub-command does not declare are config overrides (--key value), typed and checked by the config.
    args, overrides = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if overrides and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.overrides = overrides
    shown = get_verbosity()
    if not os.environ.get("LAPHEADS_VERBOSITY"):  # the command shows its progress and notices (lapheads.log)
        set_verbosity(logging.INFO)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handler is set up: one line, the shell's 130
        print(f"lapheads {args.command}: interrupted", file=sys.stderr)
        return 130
    except (LapheadsError, OSError) as err:  # anything else is a bug and keeps its traceback
        if os.environ.get("LAPHEADS_DEBUG"):
            raise
        code = getattr(err, "exit_code", 2)  # 130: interrupted, with its checkpoint saved (not an error of input)
        print(f"lapheads {args.command}: {'' if code == 130 else 'error: '}{one_line(err)}", file=sys.stderr)
        return code
    finally:  # main() called in-process (a notebook, a test) leaves the caller's verbosity as it was
        set_verbosity(shown)
