"""Where the tests find the real data of ``../shared/data`` (see its README).

The development tree keeps ``shared/`` beside the checkout; CI clones the checkout with ``shared/``
beside it too. The 10,000 MNIST digits also ship inside the package (``dptune/data/mnist-10k``, the
same files), which is the fallback, so the real-data tests never depend on where the checkout sits.
"""

from __future__ import annotations

from pathlib import Path

#: The checkout's root folder.
REPO = Path(__file__).resolve().parents[1]


def shared_data(name: str) -> Path | None:
    """``<checkout>/../shared/data/<name>`` if present, else None."""
    path = REPO.parent / "shared" / "data" / name
    return path if path.is_dir() else None


def mnist_10k() -> Path:
    """The 10k MNIST subset in IDX layout: ``../shared/data/mnist-10k`` or the shipped copy."""
    from dptune.data import MNIST_10K_DIR

    return shared_data("mnist-10k") or Path(MNIST_10K_DIR)
