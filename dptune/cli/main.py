"""The ``dptune`` command: one private tuning run from a config file.

    dptune --config=smoke --workdir=/tmp/dptune-smoke
    dptune --config=fashion_mnist --workdir=runs/fmnist \\
        --config.data.dir=/data/fashion-mnist --config.selection.mean_trials=8
    python -m dptune --config=configs/smoke.py --workdir=/tmp/dptune-smoke  # a config file

``--config`` takes a shipped config's name (listed below; ``dptune/configs/``) or a path to a
config file; ``--config.<field>=<value>`` overrides any field.

Everything is checked before anything private runs: the config, the data, the budget (the noise
multiplier is calibrated so the *total* epsilon, tuning included, meets it), the workdir and the
dataset's ledger. A problem is one line starting with ``dptune:`` and exit code 2, nothing charged
(docs/errors.md lists every exit code). Rerunning the same command with the same ``--workdir``
resumes a killed or interrupted run (same plan, same seeds, finished candidates kept); a
different config, or edited trainer code, with that workdir is refused.

What the console shows: a progress display with elapsed time and epochs of the candidate being
trained, never the number of candidates or any score (the console may be the curator's, but logs
get shared); ``--verbosity`` (``-v``) sets how much dptune logs (-1: warnings only, 0: the
default, 1: debug). ``DIR/release/`` is what may be published; ``DIR/private/`` is the curator's
(``dptune inspect DIR`` shows it). ``--debug_nonprivate`` prints every score and K and marks the
statement NOT private.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from dptune import configs, strategies
from dptune.accounting.quiet import summarised_accounting_warnings
from dptune.cli import exits, vocabulary
from dptune.cli.build import ConfigError, run_config
from dptune.cli.common import ArgumentError, normalise_argv, setup_logging
from dptune.errors import TuningConfigError
from dptune.journal import JOURNAL_FILE, ConfigChangedError
from dptune.learners.dpsgd import (
    COMPILATION_CACHE_ENV,
    DatasetNotFoundError,
    use_compilation_cache,
)
from dptune.ledger import BudgetExceededError, LedgerBudgetMismatchError
from dptune.release import NO_CANDIDATE_SUCCEEDED
from dptune.space import SpaceError
from dptune.workdir_lock import WorkdirLockedError
from selection import registry

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A shipped config's name (see the list above) or a config file."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder: private/ (journal) and release/.")
_SEED = flags.DEFINE_integer(
    "seed", None, "Fixed seed (debugging); default OS entropy. The guarantee then needs it secret."
)
_DEBUG = flags.DEFINE_bool(
    "debug_nonprivate", False, "Print every candidate's score and K; the run is then NOT private."
)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress display on stderr.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Only check the config and data and print the privacy plan; train nothing."
)
_CACHE = flags.DEFINE_string(
    "compilation_cache", None,
    "Folder of JAX's persistent compilation cache (a second run, a resumed run and Ray workers "
    f"skip compiling); 'off' disables it. Default: ${COMPILATION_CACHE_ENV} or "
    "~/.cache/dptune/jax.",
)  # fmt: skip

#: This module's own flags (``dptune --help`` lists them).
_OWN_FLAGS = (
    "config", "workdir", "seed", "debug_nonprivate", "progress", "dry_run", "compilation_cache",
)  # fmt: skip

#: Errors that are the user's to fix, raised before any private computation: one line, exit 2.
REFUSALS = (
    ConfigError,
    SpaceError,
    TuningConfigError,
    BudgetExceededError,
    LedgerBudgetMismatchError,
    ConfigChangedError,
    WorkdirLockedError,
    DatasetNotFoundError,
)

_HELP_FLAGS = ("-h", "--help", "-help", "-?", "--helpshort", "--helpfull")

log = logging.getLogger("dptune")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so the run stops the same way."""


def cli(argv: Sequence[str]) -> int:
    """The ``dptune`` command in this process: ``argv`` as in ``sys.argv``; returns the exit code
    (``dptune.cli.exits``). Prints no traceback: a refusal is one ``dptune: refused:`` line."""
    argv = list(argv)
    typed = list(argv)  # as the user typed it: the resume command repeats it
    if any(a in _HELP_FLAGS for a in argv[1:]):
        print(usage())
        return exits.OK
    try:
        argv = normalise_argv(argv)
    except ArgumentError as e:
        return exits.refuse(e)
    rest, error = _parse_flags(argv)
    if error is not None:
        return exits.refuse(error)
    previous = _install_sigterm()
    try:
        return _main(rest, argv, typed)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _parse_flags(argv: list[str]) -> tuple[list[str], str | None]:
    """absl's parsing of ``argv`` (in-process safe: the config's override flags of an earlier
    parse are removed first): ``(the arguments that are not flags, None)``, or ``([], the
    refusal text)``."""
    fv = flags.FLAGS
    for name in list(fv):
        if name.startswith("config."):
            delattr(fv, name)
    fv.unparse_flags()
    # ml_collections loads the file as module "config_config" into the entry sys.modules keeps:
    # a second parse in this process must not run a new file in the old file's namespace.
    sys.modules.pop("config_config", None)
    saved = sys.argv
    sys.argv = argv  # ml_collections reads the overrides from sys.argv
    try:
        rest = fv(argv)[1:]
    except flags.Error as e:
        return [], str(e)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        # ml_collections raises these for an override of a field the config does not have; with
        # no override given, it is the config file that failed to load
        overrides = [a.split("=")[0] for a in argv if a.startswith("--config.")]
        if not overrides:
            return [], _config_load_error(argv, e)
        return [], (
            f"a config override names a field the config does not have or gives it a value of "
            f"the wrong type ({type(e).__name__}: {e}); overrides given: {overrides}"
        )
    except Exception as e:  # noqa: BLE001 - a config file that fails to load while parsing
        return [], _config_load_error(argv, e)
    finally:
        sys.argv = saved
    return rest, None


def _config_load_error(argv: Sequence[str], e: BaseException) -> str:
    given = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "?")
    detail = " ".join(str(e).split())
    if "No such file" in detail:
        detail = "no such file"
    return (
        f"--config={given} could not be loaded ({type(e).__name__}: {detail[:300]}): fix the "
        f"file, or use a shipped config ({', '.join(configs.NAMES)})"
    )


def _main(rest: list[str], argv: list[str], typed: list[str]) -> int:
    if rest:
        return exits.refuse(
            f"unexpected arguments {rest}: every setting is a flag (--name=value); "
            "`dptune --help` lists them"
        )
    try:
        config = _CONFIG.value
    except Exception as e:  # noqa: BLE001 - config_flags defers load errors to the first access
        return exits.refuse(_config_load_error(argv, e))
    if config is None:
        return exits.refuse(
            f"--config=NAME is required: a shipped config ({', '.join(configs.NAMES)}) or a "
            "config file"
        )
    if not _WORKDIR.value:
        return exits.refuse("--workdir=DIR is required (private/ and release/ go there)")
    setup_logging()
    workdir = Path(_WORKDIR.value)
    try:
        # Set once, before anything compiles; the environment carries it to workers (Ray).
        folder = use_compilation_cache(_CACHE.value)
        os.environ[COMPILATION_CACHE_ENV] = folder or "off"
        with summarised_accounting_warnings():
            release = run_config(
                config,
                workdir,
                seed=_SEED.value,
                debug_nonprivate=_DEBUG.value,
                progress=_PROGRESS.value,
                dry_run=_DRY_RUN.value,
            )
    except REFUSALS as e:
        return exits.refuse(e)
    except KeyboardInterrupt as e:
        return _interrupted(e, workdir, typed)
    except Exception as e:  # noqa: BLE001 - a bug: one line here, the traceback in a file
        return _internal_error(e, workdir, typed)
    if _DRY_RUN.value:
        _print_dry_run(release)
        return exits.OK
    print(str(release))
    print(f"\nRelease folder: {workdir / 'release'}")
    if release.outcome == NO_CANDIDATE_SUCCEEDED:
        print(
            "dptune: no candidate succeeded: nothing was released (release/ says so). The "
            "candidates touched the data, so this run's (epsilon, delta) stays charged to the "
            f"dataset. `dptune inspect {workdir}` shows why each failed.",
            file=sys.stderr,
        )
        return exits.NO_CANDIDATE_SUCCEEDED
    return exits.OK


def _print_dry_run(dry: Any) -> None:
    print(f"Dry run (nothing trained). Search space: {dry.space.to_dict()}\n")
    print(dry.statement.to_text())
    pre = dry.preflight
    if pre is None:  # a strategy with its own plan (config.strategy)
        return
    if pre.ledger is None:
        print("\nLedger: none (config.ledger.enabled=False): this run would be charged nowhere.")
        return
    s = pre.spend
    how = (
        "has no lifetime budget yet; the run would register "
        if s.registered
        else "has the lifetime budget "
    )
    print(
        f"\nLedger {pre.ledger}: dataset {pre.fingerprint} {how}(epsilon={s.budget_epsilon:g}, "
        f"delta={s.budget_delta:g}); after this run it would have spent epsilon="
        f"{s.spent_epsilon:.4g}. Set a budget with `dptune ledger "
        f"--dataset={pre.fingerprint[:12]} --budget_epsilon=E --budget_delta=D`."
    )


def _interrupted(e: KeyboardInterrupt, workdir: Path, argv: Sequence[str]) -> int:
    """The one line after Ctrl-C / SIGTERM: what was saved, and the command that resumes."""
    signame = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
    journal = workdir / "private" / JOURNAL_FILE
    if journal.exists():
        saved = (
            f"saved in {workdir / 'private'}: the run's plan, seeds and every finished candidate "
            "(a candidate in training starts again with its own seed; a resume is not charged "
            "again)"
        )
    else:
        saved = "nothing was trained, saved or charged yet"
    print(
        f"dptune: interrupted ({signame}); {saved}. Resume with: {resume_command(argv)}",
        file=sys.stderr,
    )
    return exits.TERMINATED if isinstance(e, Terminated) else exits.INTERRUPTED


def _internal_error(e: Exception, workdir: Path, argv: Sequence[str]) -> int:
    """An unexpected error: the traceback goes to a file (private/, the curator's), one line
    here; the journal is intact, so rerunning the command resumes."""
    text = traceback.format_exc()
    private = workdir / "private"
    try:
        if private.is_dir():
            path = private / "error.log"
            with open(path, "a") as f:
                f.write(text + "\n")
        else:
            fd, name = tempfile.mkstemp(prefix="dptune-error-", suffix=".log")
            with open(fd, "w") as f:
                f.write(text)
            path = Path(name)
    except OSError:
        path = None
    if absl_logging.get_verbosity() >= 1:
        print(text, file=sys.stderr)
    where = f"the traceback is in {path}" if path else "the traceback could not be saved"
    print(
        f"dptune: error: unexpected {type(e).__name__}: {exits.one_line(e)[:300]} ({where}; a bug "
        f"in dptune or in the trainer). The journal is intact: `{resume_command(argv)}` resumes "
        "once it is fixed",
        file=sys.stderr,
    )
    return exits.INTERNAL


def resume_command(argv: Sequence[str]) -> str:
    """The command line that reruns ``argv`` (as the user typed it) as ``dptune ...``."""
    return shlex.join(["dptune", *argv[1:]])


def _install_sigterm() -> Any:
    """SIGTERM stops the run like Ctrl-C (after the current step, one line); returns the previous
    handler (None when this is not the main thread: signals cannot be set there)."""

    def handler(signum: int, frame: Any) -> None:
        raise Terminated()

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def usage() -> str:
    """``dptune --help``: this docstring, the vocabulary and the flags."""
    own = "\n".join(
        f"  --{name}: {flags.FLAGS[name].help}"
        + (f" (default: {flags.FLAGS[name].default!r})" if name != "config" else "")
        for name in _OWN_FLAGS
    )
    return (
        (__doc__ or "")
        + "\nFlags:\n"
        + own
        + "\n  --config.<field>=<value>: override one field of the config"
        + "\n  --verbosity=N (-v N): how much dptune logs (-1 warnings only, 0 default, 1 debug)"
        + "\n\nSubcommands: dptune account (the accountant), dptune inspect WORKDIR (the "
        "curator's view of a run), dptune ledger (datasets, budgets, spends), dptune audit (an "
        "empirical privacy audit).\n\n"
        + vocabulary.describe()
        + "\n\n"
        + registry.describe()
        + "\n\n"
        + strategies.describe()
        + "\n"
    )


def run() -> None:
    """Console-script entry point (``dptune``); ends the process (``exits.leave``)."""
    exits.leave(cli(sys.argv))


if __name__ == "__main__":
    run()
