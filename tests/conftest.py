"""Settings and fixtures shared by the whole test suite.

Before any test module imports JAX, the suite points dptune's cache (``$DPTUNE_CACHE``: JAX's
persistent compilation cache, remembered calibrations, scattering features) at a folder of its own,
``~/.cache/dptune-tests`` or ``$DPTUNE_TEST_CACHE``: the subprocess tests, the xdist workers and
the next run of the suite reuse compiled steps and calibrations instead of redoing them
(compilation was about 40 % of the suite's time), and the user's own cache is never written.
``DPTUNE_TEST_CACHE=off`` runs the suite cold (a fresh empty cache, warm starts off).
Every test also gets its own ledger file (``$DPTUNE_LEDGER``), so no test can charge the
developer's own ``~/.dptune/ledger.sqlite`` or see another test's spends.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest

_cache = os.environ.get("DPTUNE_TEST_CACHE") or str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dptune-tests"
)
if _cache == "off":
    os.environ["DPTUNE_COMPILATION_CACHE"] = "off"  # no compiled steps, no calibration memo
    os.environ["DPTUNE_CACHE"] = tempfile.mkdtemp(prefix="dptune-test-cache-")
else:
    # Environment variables, not jax.config: subprocesses (the CLI tests) inherit them. The
    # suite's own folder, never the user's dptune cache.
    os.environ.setdefault("DPTUNE_CACHE", _cache)
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(_cache) / "jax"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture(autouse=True)
def _own_ledger(tmp_path_factory, monkeypatch):
    """A fresh default ledger for every test (subprocesses inherit the variable)."""
    monkeypatch.setenv("DPTUNE_LEDGER", str(tmp_path_factory.mktemp("ledger") / "ledger.sqlite"))


@pytest.fixture(autouse=True)
def _library_loggers():
    """The "dptune" and "trainers" loggers as the library leaves them (no handler, propagating,
    level unset), before and after every test: an in-process CLI run (``setup_logging``), also
    one in another module's module-scoped fixture, gives them a stderr handler and stops their
    propagation, which hides their records from a later test's ``caplog`` in the same worker
    (pytest < 9.2 does not attach caplog to a non-propagating logger)."""

    def reset():
        for name in ("dptune", "trainers"):
            logger = logging.getLogger(name)
            logger.handlers[:] = []
            logger.setLevel(logging.NOTSET)
            logger.propagate = True

    reset()
    yield
    reset()


def pytest_configure(config):
    # tune() and the command charge the curator's default ledger ($DPTUNE_LEDGER, else
    # ~/.dptune/ledger.sqlite): never the real one, also from module-scoped fixtures (they run
    # before the per-test variable above is set).
    if "DPTUNE_LEDGER" not in os.environ:
        os.environ["DPTUNE_LEDGER"] = os.path.join(
            tempfile.mkdtemp(prefix="dptune-test-ledger-"), "ledger.sqlite"
        )


@pytest.fixture(scope="module")
def tfds():
    """tensorflow_datasets, or a skip saying why (it is in the ``test`` extra, so CI has it)."""
    return pytest.importorskip(
        "tensorflow_datasets",
        reason="tensorflow-datasets is not installed (pip install -e '.[test]' installs it)",
    )
