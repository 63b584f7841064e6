"""``dptune ledger``: the datasets of the budget ledger, their lifetime budgets and what each run
spent; and setting a dataset's lifetime budget explicitly.

    dptune ledger                                    # every dataset: budget, spent, left, runs
    dptune ledger --dataset=894fbd0a7125             # the runs charged to one dataset
    dptune ledger --dataset=894fbd0a7125 --budget_epsilon=8 --budget_delta=1e-5   # set its budget

``--ledger=PATH`` picks the ledger (default ``$DPTUNE_LEDGER`` or ``~/.dptune/ledger.sqlite``, the
one runs are charged to). ``--dataset`` takes a prefix of a registered dataset's id; to set the
budget of a dataset no run has touched yet, give its full id, which ``dptune --config=...
--workdir=... --dry_run`` prints. A budget can be raised or lowered, but never below what the
dataset's runs have already spent. What the ledger holds is the curator's: the runs' spends are
public functions of public settings, but the list of runs on a dataset is a record of its use.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

from absl import flags

from dptune._state.ledger import Ledger, default_ledger_path
from dptune.cli import common

#: This command's own flags (kept apart from the other commands' in one process).
FLAGS = flags.FlagValues()
_OWN = {"flag_values": FLAGS}
_LEDGER = flags.DEFINE_string("ledger", None, "The file ($DPTUNE_LEDGER if unset).", **_OWN)
_DATASET = flags.DEFINE_string("dataset", None, "A dataset id (a prefix, or a full id).", **_OWN)
_EPS = flags.DEFINE_float("budget_epsilon", None, "Set the dataset's lifetime epsilon.", **_OWN)
_DELTA = flags.DEFINE_float("budget_delta", None, "Set the dataset's lifetime delta.", **_OWN)
_NAME = flags.DEFINE_string("name", "", "A name for a dataset registered here.", **_OWN)

_FULL_ID = re.compile(r"^[0-9a-f]{64}$")


def cli(argv: Sequence[str]) -> int:
    """``dptune ledger`` in this process; returns the exit code."""
    try:
        rest = common.parse_subcommand(FLAGS, argv, __doc__)
        if rest is None:
            return common.OK
        if rest:
            return common.refuse(
                f"unexpected arguments {rest}: every setting is a flag (`dptune ledger --help`)"
            )
        path = Path(_LEDGER.value) if _LEDGER.value else default_ledger_path()
        if _EPS.value is not None or _DELTA.value is not None:
            _set(path)
        elif not path.exists():
            print(f"Ledger {path}: no dataset yet (no run has been charged to it).")
        else:
            with Ledger(path, readonly=True) as led:
                (_show if _DATASET.value else _list)(led)
        return common.OK
    except ValueError as e:  # Refused (a flag, a file) or a value the ledger refuses
        return common.refuse(e)
    finally:
        FLAGS.unparse_flags()


def _list(led: Ledger) -> None:
    rows = led.datasets()
    print(f"Ledger {led.path}: {len(rows)} dataset(s)")
    if not rows:
        return
    print(f"{'dataset':<14}{'name':<16}{'budget eps':>11}{'spent eps':>11}{'left eps':>10}"
          f"{'budget delta':>14}{'spent delta':>13}{'runs':>6}")  # fmt: skip
    for s in rows:
        print(f"{s.fingerprint[:12]:<14}{s.name[:15]:<16}{s.budget_epsilon:>11.4g}"
              f"{s.spent_epsilon:>11.4g}{s.remaining_epsilon:>10.4g}{s.budget_delta:>14.3g}"
              f"{s.spent_delta:>13.3g}{s.runs:>6}")  # fmt: skip


def _resolve(led: Ledger | None, allow_new: bool) -> str:
    """The dataset id ``--dataset`` names (``led`` None: the ledger does not exist yet)."""
    given = (_DATASET.value or "").strip().lower()
    if not given:
        raise ValueError("--dataset=ID is required to set a budget (`dptune ledger` lists ids)")
    if led is not None and (fp := led.resolve(given)):
        return fp
    if allow_new and _FULL_ID.match(given):
        return given
    hint = " (`dptune ledger` lists them)"
    if allow_new:
        hint = "; a dataset no run has touched needs its full 64-character id (--dry_run prints it)"
    raise ValueError(f"--dataset={given}: no registered dataset has that id{hint}")


def _show(led: Ledger) -> None:
    fp = _resolve(led, allow_new=False)
    spend = led.spend(fp)
    print(f"dataset {fp}: budget (epsilon={spend.budget_epsilon:g}, delta={spend.budget_delta:g}); "
          f"spent (epsilon={spend.spent_epsilon:.4g}, delta={spend.spent_delta:.3g}) in "
          f"{spend.runs} run(s)")  # fmt: skip
    for c in led.charges(fp):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["created"]))
        print(f"  {when}  epsilon={c['epsilon']:.4g}  delta={c['delta']:.3g}  {c['workdir']}")


def _set(path: Path) -> None:
    eps, delta = _EPS.value, _DELTA.value
    if eps is None or delta is None:
        raise ValueError("give both --budget_epsilon and --budget_delta to set a budget")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"--budget_epsilon={eps!r} must be a finite number > 0")
    if not 0 < delta < 1:
        raise ValueError(f"--budget_delta={delta!r} must be in (0, 1)")
    # resolved before anything is written: a refusal leaves the file as it was
    with Ledger(path, readonly=True) if path.exists() else nullcontext() as led:
        fp = _resolve(led, allow_new=True)
    with Ledger(path) as led:
        before = led.spend(fp)
        after = led.set_budget(fp, eps, delta, _NAME.value)
    was = "registered"
    if before is not None:
        was = f"changed from (epsilon={before.budget_epsilon:g}, delta={before.budget_delta:g})"
    print(
        f"Ledger {path}: dataset {fp[:12]}'s lifetime budget {was} to (epsilon={eps:g}, "
        f"delta={delta:g}); spent so far epsilon={after.spent_epsilon:.4g}."
    )


if __name__ == "__main__":
    common.entry(cli)
