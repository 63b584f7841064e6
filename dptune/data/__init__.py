"""Small real datasets shipped with dptune (see each folder's README for source and licence)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

#: Folder holding 10,000 MNIST digits (8,000 train / 2,000 test) in IDX gz layout, for offline runs.
MNIST_10K_DIR: Path = Path(__file__).resolve().parent / "mnist-10k"

#: Public size of the shipped subset's training file (its published size: it ships with dptune).
MNIST_10K_NUM_TRAIN: int = 8000


def load_mnist_10k() -> tuple:
    """The shipped 10,000 MNIST digits as NumPy arrays: ``(x_train, y_train, x_test, y_test)``,
    images float32 (n, 28, 28, 1) in [0, 1] and labels int32 (n,); 8,000 train and 2,000 test.

    For examples of user data (``dptune.Dataset.from_arrays(x_train, y_train,
    num_examples=MNIST_10K_NUM_TRAIN, ...)``); the built-in configs read the same files.
    """

    def read(name: str) -> np.ndarray:
        # IDX: zero bytes, type 0x08 (unsigned byte), number of dimensions, big-endian sizes.
        raw = gzip.decompress((MNIST_10K_DIR / name).read_bytes())
        ndim = raw[3]
        dims = np.frombuffer(raw, ">u4", count=ndim, offset=4).astype(int)
        return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(tuple(dims))

    def images(name: str) -> np.ndarray:
        return (read(name).astype(np.float32) / 255.0)[..., None]

    return (
        images("train-images-idx3-ubyte.gz"),
        read("train-labels-idx1-ubyte.gz").astype(np.int32),
        images("t10k-images-idx3-ubyte.gz"),
        read("t10k-labels-idx1-ubyte.gz").astype(np.int32),
    )
