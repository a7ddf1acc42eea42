"""Command-line help shared by mesa_lite's launcher and the benchmark scripts (argparse only:
importing it costs nothing, so ``--help`` answers at once)."""

from __future__ import annotations

import argparse
import os
import sys


def print_rank0(line: str) -> None:
    """``line`` on stderr, once per run: only on rank 0 under torchrun (``RANK``)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def _shown(default) -> str:
    if default is None:
        return "none"
    if isinstance(default, (list, tuple)):
        return " ".join(map(str, default))
    return str(default)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and epilog's layout and ends each option's help with its default
    ("none" when unset, lists space-separated), unless the help states it (defaults that depend
    on the device) or the option is a flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "(default" in text
            or not action.option_strings
            or action.nargs == 0  # flags: --help, store_true, --x/--no-x
            or action.default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: {_shown(action.default).replace('%', '%%')})"
