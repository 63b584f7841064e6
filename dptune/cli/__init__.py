"""dptune's command lines: ``dptune`` (a tuning run from a config, ``dptune.cli.main``) and its
subcommands, each in its own module so that one command's absl flags never mix with another's.

    dptune --config=smoke --workdir=/tmp/dptune-smoke     # a private tuning run
    dptune account --sampling_rate=0.004 --steps=7032 --noise_multiplier=1.1   # the accountant
    dptune inspect /tmp/dptune-smoke                       # the curator's (private) view of a run
    dptune ledger                                          # datasets, budgets and spends
    dptune audit --config=smoke --workdir=/tmp/dptune-audit   # an empirical privacy audit

Every command refuses a mistake with one ``dptune:`` line and exit code 2 (docs/errors.md);
``dptune.cli.build`` turns a config into the library's objects (the one place that does)."""

from __future__ import annotations

import importlib
import sys

#: ``dptune NAME ...``: the subcommands and the module whose ``cli(argv)`` serves each.
SUBCOMMANDS = {
    "account": "dptune.cli.account",
    "inspect": "dptune.cli.inspect",
    "ledger": "dptune.cli.ledger",
    "audit": "dptune.cli.audit",
}


def run() -> None:
    """Console-script entry point (``dptune``): a subcommand, or a tuning run."""
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
        name = sys.argv.pop(1)
        sys.argv[0] = f"dptune {name}"
        command = importlib.import_module(SUBCOMMANDS[name]).cli
    else:
        command = importlib.import_module("dptune.cli.main").cli
    importlib.import_module("dptune.cli.common").entry(command)
