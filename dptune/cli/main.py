"""The ``dptune`` command: one private tuning run from a config file.

    dptune --config=fashion_mnist --workdir=runs/fmnist --config.data.dir=/data/fashion-mnist

``--config`` takes a shipped config's name or a config file; ``--config.<field>=<value>`` overrides
any field. Everything is checked before anything private runs; a problem is one ``dptune:`` line
and exit code 2, nothing charged (docs/errors.md). Rerunning the same command resumes a killed or
interrupted run. The console never shows the number of candidates or a score; ``DIR/release/`` is
what may be published, ``DIR/private/`` the curator's (``dptune inspect DIR``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from absl import flags
from ml_collections import config_flags

from dptune import strategies
from dptune.accounting.quiet import summarised_accounting_warnings
from dptune.cli import common, vocabulary
from dptune.cli.build import run_config
from dptune.errors import Refused
from dptune.learners.dpsgd import COMPILATION_CACHE_ENV, use_compilation_cache
from dptune.release import NO_CANDIDATE_SUCCEEDED
from selection import registry

FLAGS = flags.FLAGS
_CONFIG = config_flags.DEFINE_config_file("config", None, "A shipped config's name or a file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder: private/ (journal) and release/.")
_SEED = flags.DEFINE_integer("seed", None, "Fixed seed (debugging; then keep it secret).")
_DEBUG = flags.DEFINE_bool("debug_nonprivate", False, "Print every score and K: NOT private.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress display on stderr.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Check and print the privacy plan; train nothing.")
_CACHE = flags.DEFINE_string(
    "compilation_cache", None, f"JAX's compilation cache, or 'off' (${COMPILATION_CACHE_ENV})"
)

_OWN = ("config", "workdir", "seed", "debug_nonprivate", "progress", "dry_run", "compilation_cache")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt: the run stops the same way."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def cli(argv: list[str]) -> int:
    """The ``dptune`` command in this process (``argv`` as in ``sys.argv``); returns the exit
    code. Prints no traceback: a refusal is one ``dptune: refused:`` line."""
    if any(a in common.HELP for a in argv[1:]):
        print(usage())
        return common.OK
    try:
        config, workdir = common.parse_run_command(FLAGS, argv, "private/ and release/ go there")
    except Refused as e:
        return common.refuse(e)
    common.setup_logging()
    main = threading.current_thread() is threading.main_thread()  # signals: main thread only
    previous = signal.signal(signal.SIGTERM, _terminate) if main else None
    try:
        os.environ[COMPILATION_CACHE_ENV] = use_compilation_cache(_CACHE.value) or "off"
        with summarised_accounting_warnings():
            release = run_config(
                config, workdir, seed=_SEED.value, dry_run=_DRY_RUN.value,
                debug_nonprivate=_DEBUG.value, progress=_PROGRESS.value,
            )  # fmt: skip
    except Refused as e:
        return common.refuse(e)
    except KeyboardInterrupt as e:
        return common.interrupted(isinstance(e, Terminated), workdir / "private", argv)
    except Exception as e:  # noqa: BLE001 - a full disk is the user's; anything else a bug
        return common.unexpected(e, workdir / "private", argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(
        release.to_text() if _DRY_RUN.value else f"{release}\n\nRelease folder: {workdir}/release"
    )
    if not _DRY_RUN.value and release.outcome == NO_CANDIDATE_SUCCEEDED:
        print(f"dptune: no candidate succeeded: nothing was released; this run's (epsilon, delta) "
              f"stays charged (the candidates touched the data). `dptune inspect {workdir}` shows "
              "why each failed.", file=sys.stderr)  # fmt: skip
        return common.NO_CANDIDATE_SUCCEEDED
    return common.OK


def usage() -> str:
    """``dptune --help``: this docstring, the flags, the subcommands and the vocabulary."""
    return "\n\n".join([
        common.help_text(__doc__, FLAGS, _OWN)
        + "\n  --config.<field>=<value>: override one field of the config"
        + "\n  --verbosity=N (-v N): how much dptune logs (-1 warnings only, 0 default, 1 debug)",
        "Subcommands: dptune account | inspect WORKDIR | ledger | audit (each has --help).",
        "\n".join(f"{kind}: {', '.join(names)}" for kind, names in vocabulary.vocabulary().items()),
        registry.describe(), strategies.describe(),
    ])  # fmt: skip


def run() -> None:
    """Console-script entry point (``dptune``)."""
    common.entry(cli)


if __name__ == "__main__":
    run()
