"""Fixtures shared by the learners' tests."""

import pytest

from dptune.data import MNIST_10K_NUM_TRAIN
from tests.paths import mnist_10k
from trainers.data import load_dataset


@pytest.fixture(scope="module")
def mnist():
    """The shipped 10k MNIST digits, 1,000 of them held out for validation."""
    return load_dataset(
        "mnist", str(mnist_10k()), validation_size=1000, source="idx",
        num_examples=MNIST_10K_NUM_TRAIN,
    )  # fmt: skip
