"""Fixtures shared by several test modules."""

import os
import tempfile

import pytest


def pytest_configure(config):
    # tune() and the command charge the curator's default ledger ($DPTUNE_LEDGER, else
    # ~/.dptune/ledger.sqlite): never the real one from a test (module-scoped fixtures included).
    if "DPTUNE_LEDGER" not in os.environ:
        os.environ["DPTUNE_LEDGER"] = os.path.join(
            tempfile.mkdtemp(prefix="dptune-test-ledger-"), "ledger.sqlite"
        )


@pytest.fixture(autouse=True)
def _own_ledger(tmp_path_factory, monkeypatch):
    """Each test's default ledger is its own, so runs of different tests never share a budget."""
    monkeypatch.setenv("DPTUNE_LEDGER", str(tmp_path_factory.mktemp("ledger") / "ledger.sqlite"))


@pytest.fixture(scope="module")
def tfds():
    """tensorflow_datasets, or a skip saying why (it is in the ``test`` extra, so CI has it)."""
    return pytest.importorskip(
        "tensorflow_datasets",
        reason="tensorflow-datasets is not installed (pip install -e '.[test]' installs it)",
    )
