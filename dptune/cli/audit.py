"""``dptune audit``: an empirical privacy audit of a config's run, next to the epsilon it states.

    dptune audit --config=smoke --workdir=/tmp/dptune-audit
    dptune audit --config=smoke --workdir=/tmp/audit-one --what=training --canaries=500
    dptune audit --config=smoke --workdir=/tmp/control --what=training --break=no_noise

The config's run (its data, trainer, search space, selection and budget, as ``dptune`` would run
it) is repeated with m canaries added to the private data, each included with probability 1/2
(OS entropy); every canary is scored on the released candidate and the guesses become a lower
bound on epsilon at the stated delta with the given confidence (Steinke, Nasr & Jagielski 2023).
``DIR/audit.json`` and ``DIR/audit.md`` hold the result; ``DIR/release/`` is the audit's release,
marked as an audit, never the dataset's. The ledger charges an audit entry of its own.

--kind: gradient (white-box: the DP-SGD step, through canaries whose gradient is a Dirac on a
parameter block of their own), input (black-box: out-of-distribution images scored by their
loss), score (validation canaries read from the released score). --break: a negative control that
makes training NOT private, to show the audit catches it: no_noise, no_clipping, noise_reused,
exact_score. docs/audit.md says what the number means and what it does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from dptune.auditing import BREAKS, KINDS, WHATS
from dptune.auditing.run import AUDIT_JSON, AUDIT_MD, audit
from dptune.cli import build
from dptune.cli.common import parse_flags, resolve_config_names, setup_logging
from dptune.errors import TuningConfigError
from dptune.journal import ConfigChangedError
from dptune.ledger import BudgetExceededError, LedgerBudgetMismatchError, default_ledger_path
from dptune.plan import Budget
from dptune.space import Space, SpaceError
from dptune.workdir_lock import WorkdirLockedError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A shipped config's name (smoke, mnist, ...) or a config file."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "The audit's own folder (never a tuning run's).")
_WHAT = flags.DEFINE_enum(
    "what", "tuning", WHATS, "tuning: the whole run as released; training: one candidate."
)
_CANARIES = flags.DEFINE_integer(
    "canaries", None, "m, the number of canaries (default 1000; 20 for --kind=score)."
)
_KIND = flags.DEFINE_enum(
    "kind", None, KINDS, "Canaries: gradient (default for DP-SGD), input or score."
)
_BREAK = flags.DEFINE_enum(
    "break", None, BREAKS, "A negative control: training deliberately NOT private."
)
_CONFIDENCE = flags.DEFINE_float("confidence", 0.95, "Confidence of the lower bound, in (0, 1).")
_SEED = flags.DEFINE_integer(
    "seed", None, "Fixed seed of the canaries, their coins and the run (tests); default OS entropy"
)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress display on stderr.")


def run_audit(cfg, workdir: str, **kwargs):
    """The audit of config ``cfg`` (what the command does after parsing flags); ``kwargs`` go to
    ``dptune.audit``. Config -> objects through ``dptune.cli.build``."""
    cfg = build._plain(cfg)
    build.check_config(cfg)
    method = build.build_selection(cfg)
    try:
        space = Space.from_config(cfg["space"])
        budget = Budget(build._number(cfg, "privacy.epsilon"), build._number(cfg, "privacy.delta"))
    except ValueError as e:
        raise build.ConfigError(str(e)) from None
    trainer = build.build_trainer(cfg, build.load_data(cfg), progress=kwargs.get("progress", True))
    ledger_cfg = cfg.get("ledger", {}) or {}
    ledger = None
    if ledger_cfg.get("enabled", True):
        ledger = ledger_cfg.get("path") or default_ledger_path()
    return audit(
        trainer, space, method, budget, workdir=workdir, ledger=ledger, config=cfg,
        accountant=str(build._get(cfg, "privacy.accountant", "auto")),
        adjacency=str(build._get(cfg, "privacy.adjacency", "add_remove")), **kwargs,
    )  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config=NAME or a config file is required")
    if not _WORKDIR.value:
        raise app.UsageError("--workdir=DIR is required (the audit's own folder)")
    setup_logging()
    try:
        result = run_audit(
            _CONFIG.value, _WORKDIR.value, what=_WHAT.value, canaries=_CANARIES.value,
            kind=_KIND.value, break_=flags.FLAGS["break"].value, confidence=_CONFIDENCE.value,
            seed=_SEED.value, progress=_PROGRESS.value,
        )  # fmt: skip
    except (
        build.ConfigError, SpaceError, TuningConfigError, BudgetExceededError,
        LedgerBudgetMismatchError, ConfigChangedError, WorkdirLockedError,
    ) as e:  # fmt: skip
        print(f"dptune: refused: {e}", file=sys.stderr)
        return 2
    work = Path(_WORKDIR.value)
    print(str(result))
    print(f"\n{work / AUDIT_MD}\n{work / AUDIT_JSON}")
    return 0


def run() -> None:
    """Console-script entry point (``dptune audit``)."""
    sys.argv = resolve_config_names(sys.argv)
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=parse_flags)


if __name__ == "__main__":
    run()
