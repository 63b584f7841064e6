"""The tiny dataset and config the command's tests share (``bad_inputs_config.py``): a few hundred
synthetic digits written as MNIST IDX files, trained by DP-Fisher (NumPy: nothing to compile)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

#: The tiny config (``--config=CONFIG --config.data.dir=<a folder write_dataset wrote>``).
CONFIG = str(Path(__file__).with_name("bad_inputs_config.py"))
N_TRAIN, N_TEST = 240, 60


def write_idx(path: Path, array: np.ndarray, *, gz: bool = False) -> None:
    """``array`` (uint8) as an IDX file (big-endian header: 0, 0, 0x08, ndim, dims)."""
    a = np.asarray(array, dtype=np.uint8)
    raw = bytes([0, 0, 8, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape)
    raw += a.tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


IDX = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def make_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, size=(10, 28, 28))

    def draw(n):
        y = rng.integers(0, 10, n)
        return np.clip(templates[y] + rng.normal(0, 40, (n, 28, 28)), 0, 255), y

    (tx, ty), (sx, sy) = draw(N_TRAIN), draw(N_TEST)
    return {"train_x": tx, "train_y": ty, "test_x": sx, "test_y": sy}


def write_dataset(folder: Path, arrays: dict[str, np.ndarray] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for key, a in (arrays or make_arrays()).items():
        write_idx(folder / IDX[key], a)
    return folder
