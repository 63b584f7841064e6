"""Small real datasets shipped with dptune (see each folder's README for source and licence)."""

from __future__ import annotations

from pathlib import Path

#: Folder holding 10,000 MNIST digits (8,000 train / 2,000 test) in IDX gz layout, for offline runs.
MNIST_10K_DIR: Path = Path(__file__).resolve().parent / "mnist-10k"

#: Public size of the shipped subset's training file (its published size: it ships with dptune).
MNIST_10K_NUM_TRAIN: int = 8000
