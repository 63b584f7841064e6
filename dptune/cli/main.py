"""The ``dptune`` command: one private tuning run from a config file.

    dptune --config=smoke --workdir=/tmp/dptune-smoke
    dptune --config=fashion_mnist --workdir=runs/fmnist \\
        --config.data.dir=/data/fashion-mnist --config.selection.mean_trials=8
    python -m dptune --config=configs/smoke.py --workdir=/tmp/dptune-smoke  # a config file

``--config`` takes a shipped config's name (listed below; ``dptune/configs/``) or a path to a
config file; ``--config.<field>=<value>`` overrides any field.

Everything is checked before anything private runs: the config, the data, the budget (the noise
multiplier is calibrated so the *total* epsilon, tuning included, meets it) and the dataset's
ledger. Rerunning the same command with the same ``--workdir`` resumes a killed run (same plan,
same seeds, finished candidates kept); a different config with that workdir is refused.

What the console shows: a progress display with elapsed time and epochs of the candidate being
trained, never the number of candidates or any score (the console may be the curator's, but logs
get shared). ``DIR/release/`` is what may be published; ``DIR/private/`` is the curator's.
``--debug_nonprivate`` prints every score and K and marks the statement NOT private.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from dptune import strategies
from dptune.cli import vocabulary
from dptune.cli.build import ConfigError, run_config
from dptune.cli.common import parse_flags, resolve_config_names, setup_logging
from dptune.errors import TuningConfigError
from dptune.journal import ConfigChangedError
from dptune.learners.dpsgd import COMPILATION_CACHE_ENV, use_compilation_cache
from dptune.ledger import BudgetExceededError, LedgerBudgetMismatchError
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

log = logging.getLogger("dptune")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config=configs/<name>.py is required")
    if not _WORKDIR.value:
        raise app.UsageError("--workdir=DIR is required (private/ and release/ go there)")
    setup_logging()
    try:
        # Set once, before anything compiles; the environment carries it to workers (Ray).
        folder = use_compilation_cache(_CACHE.value)
        os.environ[COMPILATION_CACHE_ENV] = folder or "off"
        release = run_config(
            _CONFIG.value,
            _WORKDIR.value,
            seed=_SEED.value,
            debug_nonprivate=_DEBUG.value,
            progress=_PROGRESS.value,
            dry_run=_DRY_RUN.value,
        )
    except (
        ConfigError,
        SpaceError,
        TuningConfigError,
        BudgetExceededError,
        LedgerBudgetMismatchError,
        ConfigChangedError,
        WorkdirLockedError,
    ) as e:
        print(f"dptune: refused: {e}", file=sys.stderr)
        return 2
    if _DRY_RUN.value:
        space, statement = release
        print(f"Dry run (nothing trained). Search space: {space.to_dict()}\n")
        print(statement.to_text())
        return 0
    print(str(release))
    print(f"\nRelease folder: {Path(_WORKDIR.value) / 'release'}")
    return 0


def run() -> None:
    """Console-script entry point (``dptune``)."""
    sys.argv = resolve_config_names(sys.argv)
    # `dptune --help` documents this module's flags (absl shows the main module's key flags, and
    # the console script's main module is the script, not this file).
    for name in (
        "config",
        "workdir",
        "seed",
        "debug_nonprivate",
        "progress",
        "dry_run",
        "compilation_cache",
    ):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])
    main_module = sys.modules["__main__"]
    main_module.__doc__ = (
        (__doc__ or "")
        + "\n"
        + vocabulary.describe()
        + "\n\n"
        + registry.describe()
        + "\n\n"
        + strategies.describe()
        + "\n"
    )
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=parse_flags)


if __name__ == "__main__":
    run()
