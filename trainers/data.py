"""Datasets as in-memory numpy arrays: tensorflow-datasets, local IDX / CIFAR-10 pickle folders,
synthetic.

Every loader returns a :class:`Dataset` with images as float32 NHWC in [0, 1] and labels as int32.
The validation split is carved from the training set with a fixed, public size and a fixed, public
permutation (``seed_split``), so the split itself reveals nothing about the data; the test split is
only for reporting.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import os
import pickle
from pathlib import Path

import numpy as np

NAMES = ("mnist", "fashion_mnist", "cifar10", "synthetic")
SOURCES = ("auto", "tfds", "idx", "cifar_pickle", "synthetic")

# IDX file names of the MNIST layout; "-" or "." before "idx" both occur in the wild.
_IDX_FILES = {
    "train_x": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "train_y": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "test_x": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "test_y": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}

_HOW_TO_POINT = (
    "Point dptune at local files with data_dir=<folder> (and source='idx' for a folder in the "
    "MNIST IDX layout train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
    "t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]; source='cifar_pickle' for the "
    "CIFAR-10 python folder with data_batch_1..5 and test_batch), or install tensorflow-datasets "
    "with `pip install 'dptune[tfds]'` (needs internet once, or a prepared TFDS data_dir)."
)


class DatasetNotFoundError(FileNotFoundError):
    """The dataset could not be found locally or through tensorflow-datasets; the message says how
    to fix it."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """In-memory dataset split into train / validation / test.

    Attributes:
      train_x, val_x, test_x: float32 arrays of shape (n, height, width, channels), values in [0,
        1].
      train_y, val_y, test_y: int32 arrays of shape (n,), values in [0, num_classes).
      num_classes: number of classes.
      name: dataset name (one of ``NAMES``).
    """

    train_x: np.ndarray
    train_y: np.ndarray
    val_x: np.ndarray
    val_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    name: str

    def fingerprint(self) -> str:
        """sha256 (hex) of the training and validation arrays (shapes, dtypes and bytes): the
        private data.

        Used by the budget ledger to charge every run on the same data to the same budget.
        """
        h = hashlib.sha256()
        for arr in (self.train_x, self.train_y, self.val_x, self.val_y):
            a = np.ascontiguousarray(arr)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        return h.hexdigest()

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(height, width, channels) of one image."""
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]

    def __repr__(self) -> str:  # arrays are large: show shapes only
        return (
            f"Dataset(name={self.name!r}, train={self.train_x.shape}, val={self.val_x.shape}, "
            f"test={self.test_x.shape}, num_classes={self.num_classes})"
        )


def load_dataset(
    name: str,
    data_dir: str | os.PathLike | None = None,
    validation_size: int = 5000,
    source: str = "auto",
    seed_split: int = 0,
) -> Dataset:
    """Loads ``name`` and carves a validation split of ``validation_size`` examples from its
    training set.

    Args:
      name: "mnist", "fashion_mnist", "cifar10" or "synthetic".
      data_dir: a local folder (IDX layout, CIFAR-10 pickle layout) or a TFDS data_dir.
      validation_size: number of training examples moved to the validation split (public, fixed).
      source: "auto" (a local folder if ``data_dir`` holds one, else TFDS), "tfds", "idx",
        "cifar_pickle", "synthetic".
      seed_split: seed of the public permutation that picks the validation examples.

    Raises:
      DatasetNotFoundError: the data is not there; the message says how to point at local files.
      ValueError: an unknown name/source or an impossible validation size.
    """
    if name not in NAMES:
        raise ValueError(f"unknown dataset name {name!r}; expected one of {NAMES}")
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")
    if name == "synthetic" or source == "synthetic":
        train_x, train_y, test_x, test_y, num_classes = _synthetic_arrays()
        name = "synthetic"
    else:
        if source == "auto":
            source = _detect_source(name, data_dir)
        if source == "idx":
            train_x, train_y, test_x, test_y = _load_idx(_require_dir(name, data_dir))
            num_classes = 10
        elif source == "cifar_pickle":
            train_x, train_y, test_x, test_y = _load_cifar_pickle(_require_dir(name, data_dir))
            num_classes = 10
        else:
            train_x, train_y, test_x, test_y = _load_tfds(name, data_dir)
            num_classes = 10
    return split_validation(
        train_x, train_y, test_x, test_y, num_classes, name, validation_size, seed_split
    )


def split_validation(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    name: str,
    validation_size: int,
    seed_split: int = 0,
) -> Dataset:
    """Moves ``validation_size`` training examples, chosen by a public permutation, to a validation
    split."""
    n = len(train_x)
    if not 0 <= validation_size < n:
        raise ValueError(
            f"validation_size={validation_size} must be >= 0 and smaller than the {n} training "
            "examples"
        )
    perm = np.random.default_rng(seed_split).permutation(n)
    val_idx, tr_idx = np.sort(perm[:validation_size]), np.sort(perm[validation_size:])
    return Dataset(
        train_x=np.ascontiguousarray(train_x[tr_idx]),
        train_y=np.ascontiguousarray(train_y[tr_idx]),
        val_x=np.ascontiguousarray(train_x[val_idx]),
        val_y=np.ascontiguousarray(train_y[val_idx]),
        test_x=test_x,
        test_y=test_y,
        num_classes=num_classes,
        name=name,
    )


def make_synthetic(
    num_train: int = 6000,
    num_test: int = 1000,
    validation_size: int = 1000,
    image_shape: tuple[int, int, int] = (28, 28, 1),
    num_classes: int = 10,
    noise: float = 0.3,
    seed: int = 0,
) -> Dataset:
    """A learnable synthetic image dataset: a fixed random template per class plus Gaussian pixel
    noise.

    ``num_train`` counts the training examples before the validation split is carved out.
    """
    train_x, train_y, test_x, test_y, _ = _synthetic_arrays(
        num_train, num_test, image_shape, num_classes, noise, seed
    )
    return split_validation(
        train_x, train_y, test_x, test_y, num_classes, "synthetic", validation_size, seed
    )


def _synthetic_arrays(
    num_train: int = 10000,
    num_test: int = 2000,
    image_shape: tuple[int, int, int] = (28, 28, 1),
    num_classes: int = 10,
    noise: float = 0.3,
    seed: int = 0,
):
    rng = np.random.default_rng(seed)
    # Smooth-ish templates (upsampled 7x7 blobs) so that a small CNN with 8x8 filters can tell them
    # apart.
    h, w, c = image_shape
    coarse = rng.uniform(0.0, 1.0, size=(num_classes, (h + 3) // 4, (w + 3) // 4, c))
    templates = np.repeat(np.repeat(coarse, 4, axis=1), 4, axis=2)[:, :h, :w, :]

    def draw(n):
        y = rng.integers(0, num_classes, size=n).astype(np.int32)
        x = templates[y] + noise * rng.standard_normal((n, h, w, c))
        return np.clip(x, 0.0, 1.0).astype(np.float32), y

    train_x, train_y = draw(num_train)
    test_x, test_y = draw(num_test)
    return train_x, train_y, test_x, test_y, num_classes


def _require_dir(name: str, data_dir) -> Path:
    if data_dir is None:
        raise DatasetNotFoundError(f"no data_dir given for dataset {name!r}. {_HOW_TO_POINT}")
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise DatasetNotFoundError(
            f"data_dir {str(path)!r} for {name!r} is not a folder. {_HOW_TO_POINT}"
        )
    return path


def _find_idx(folder: Path, key: str) -> Path | None:
    for stem in _IDX_FILES[key]:
        for suffix in (".gz", ""):
            p = folder / (stem + suffix)
            if p.is_file():
                return p
    return None


def _cifar_folder(folder: Path) -> Path | None:
    for cand in (folder, folder / "cifar-10-batches-py"):
        if (cand / "data_batch_1").is_file() and (cand / "test_batch").is_file():
            return cand
    return None


def _detect_source(name: str, data_dir) -> str:
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if folder.is_dir() and all(_find_idx(folder, k) for k in _IDX_FILES):
            return "idx"
        if folder.is_dir() and _cifar_folder(folder) is not None:
            return "cifar_pickle"
    return "tfds"


def _read_idx(path: Path) -> np.ndarray:
    """Reads one IDX file (gzip or raw): big-endian magic 0x0000 <dtype=0x08 ubyte> <ndim>, then
    dims, then data."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (magic bytes {raw[:4]!r})")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says shape {tuple(dims)} but holds {data.size} bytes")
    return data.reshape(tuple(dims))


def _load_idx(folder: Path):
    paths = {k: _find_idx(folder, k) for k in _IDX_FILES}
    missing = [_IDX_FILES[k][0] for k, p in paths.items() if p is None]
    if missing:
        raise DatasetNotFoundError(f"{str(folder)!r} lacks IDX files {missing}. {_HOW_TO_POINT}")
    arrays = {k: _read_idx(p) for k, p in paths.items()}

    def images(a):
        return (a.astype(np.float32) / 255.0)[..., None]

    return (
        images(arrays["train_x"]),
        arrays["train_y"].astype(np.int32),
        images(arrays["test_x"]),
        arrays["test_y"].astype(np.int32),
    )


def _load_cifar_pickle(folder: Path):
    root = _cifar_folder(folder)
    if root is None:
        raise DatasetNotFoundError(
            f"{str(folder)!r} holds no CIFAR-10 python folder (data_batch_1..5, test_batch). "
            + _HOW_TO_POINT
        )

    def read(p: Path):
        with open(p, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return x.astype(np.float32) / 255.0, np.asarray(d[b"labels"], dtype=np.int32)

    parts = [read(root / f"data_batch_{i}") for i in range(1, 6)]
    test_x, test_y = read(root / "test_batch")
    return (
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        test_x,
        test_y,
    )


def _load_tfds(name: str, data_dir):
    """(train_x, train_y, test_x, test_y) through tensorflow-datasets.

    With TensorFlow installed: ``tfds.load(..., batch_size=-1)`` (TFRecord files, tfds' default).
    Without it: ``tfds.data_source`` (ArrayRecord files, random access, no TensorFlow needed; tfds
    >= 4.9), which is what the `test` extra installs and what the offline tests exercise through
    ``tfds.testing.mock_data``.
    """
    try:
        import tensorflow_datasets as tfds  # optional extra
    except ImportError as e:
        raise DatasetNotFoundError(
            f"tensorflow-datasets is not installed, so {name!r} cannot be downloaded. "
            + _HOW_TO_POINT
        ) from e
    folder = None if data_dir is None else str(data_dir)
    try:
        if importlib.util.find_spec("tensorflow") is not None:
            splits = tfds.load(
                name, split=["train", "test"], batch_size=-1, as_supervised=True, data_dir=folder
            )
            (train_x, train_y), (test_x, test_y) = tfds.as_numpy(splits)
        else:
            sources = {
                split: tfds.data_source(name, split=split, data_dir=folder)
                for split in ("train", "test")
            }
            train_x, train_y = _read_data_source(sources["train"])
            test_x, test_y = _read_data_source(sources["test"])
    except Exception as e:  # download or preparation failures come in many types
        raise DatasetNotFoundError(
            f"tensorflow-datasets could not load {name!r}: {e}. {_HOW_TO_POINT}"
        ) from e
    return (
        np.asarray(train_x).astype(np.float32) / 255.0,
        np.asarray(train_y).astype(np.int32),
        np.asarray(test_x).astype(np.float32) / 255.0,
        np.asarray(test_y).astype(np.int32),
    )


def _read_data_source(source) -> tuple[np.ndarray, np.ndarray]:
    """All records of a tfds data source as (uint8 images (n, h, w, c), labels (n,)), in order."""
    n = len(source)
    if n == 0:
        raise ValueError("the split is empty")
    records = [source[i] for i in range(n)]
    images = np.stack([np.asarray(r["image"]) for r in records])
    labels = np.asarray([r["label"] for r in records])
    return images, labels
