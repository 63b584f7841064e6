"""Fixtures shared by several test modules."""

import pytest


@pytest.fixture(scope="module")
def tfds():
    """tensorflow_datasets, or a skip saying why (it is in the ``test`` extra, so CI has it)."""
    return pytest.importorskip(
        "tensorflow_datasets",
        reason="tensorflow-datasets is not installed (pip install -e '.[test]' installs it)",
    )
