"""dptune's command lines: ``dptune`` (a tuning run, ``dptune.cli.main``) and its subcommands
(``dptune --help`` lists them), each in its own module so that one command's absl flags never mix
with another's. ``dptune.cli.build`` turns a config into the library's objects."""

from __future__ import annotations

import importlib
import sys

#: ``dptune NAME ...``: the subcommands and the module whose ``cli(argv)`` serves each.
SUBCOMMANDS = {name: f"dptune.cli.{name}" for name in ("account", "inspect", "ledger", "audit")}


def run() -> None:
    """Console-script entry point (``dptune``): a subcommand, or a tuning run."""
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
        name = sys.argv.pop(1)
        sys.argv[0] = f"dptune {name}"
        command = importlib.import_module(SUBCOMMANDS[name]).cli
    else:
        command = importlib.import_module("dptune.cli.main").cli
    importlib.import_module("dptune.cli.common").entry(command)
