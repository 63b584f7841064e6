"""Datasets as in-memory numpy arrays: tensorflow-datasets, local IDX / CIFAR-10 pickle folders,
synthetic.

Every loader returns a :class:`Dataset` with images as float32 NHWC in [0, 1] and labels as int32.
The validation split is carved from the training file record by record: each record's split is a
keyed hash of that record alone (public key and seed), so adding or removing one person never moves
another between training and validation. Sizes that privacy depends on are public (the published
size of the file, or one the user declares), never ``len()`` of the private arrays. The test split
is public and only for reporting (docs/privacy-model.md).

Malformed records are handled per record (``drop_invalid_records``): a training or validation record
whose label is out of range or whose features are not finite is dropped by looking at that record
alone, a stable transformation that leaves every guarantee unchanged (docs/privacy-model.md), and
counted for the curator (``Dataset.sanitized``). The public test split is checked and refused
instead (``check_public_split``); a file that cannot be read as its format (truncated, corrupt,
images and labels of different counts, wrong shapes) is refused with its path.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.util
import logging
import os
import pickle
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

NAMES = ("mnist", "fashion_mnist", "cifar10", "synthetic")
SOURCES = ("auto", "tfds", "idx", "cifar_pickle", "synthetic")
#: Sources of a user's own arrays (``Dataset.from_arrays``): an ``.npz`` file (``read_npz``) or a
#: loader function ``pkg.module:function`` that returns them.
ARRAY_SOURCES = ("npz", "loader")
#: Keys of a user's arrays (npz file or loader dict); the test split is optional.
ARRAY_KEYS = ("x_train", "y_train", "x_test", "y_test")

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


#: Published sizes of the training files (before any validation split): the public nominal sizes
#: that sampling rates and step counts are computed from (never ``len()`` of private arrays).
PUBLISHED_TRAIN_SIZES: dict[str, int] = {"mnist": 60000, "fashion_mnist": 60000, "cifar10": 50000}

#: Largest relative difference between the loaded and the declared number of training records
#: before loading warns: a guard against declaring the wrong size (e.g. the 10k MNIST subset as
#: "mnist"), not a privacy mechanism (the guarantee holds whatever the loaded size; see
#: docs/privacy-model.md). A warning, never a refusal: the loaded size is private.
SIZE_TOLERANCE = 0.01

#: Public key of the per-record split hash (fixed; changing it is a new split of the same people).
SPLIT_KEY = b"dptune/record-split/v1"


def record_digests(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """sha256 of each record: its input's bytes (as float32 for floating-point inputs; as int64,
    prefixed by the tag ``int64:``, for integer inputs such as token ids) and its label as int32.

    Returns an array of shape (n,) of 32-byte ``bytes`` objects (dtype object). A record's digest
    depends on that record alone: it is what the split and the ledger fingerprint are built from.
    """
    integer = np.issubdtype(np.asarray(x).dtype, np.integer)
    dtype = np.int64 if integer else np.float32
    x = np.ascontiguousarray(x, dtype=dtype).reshape(len(x), int(np.prod(np.shape(x)[1:])))
    y = np.asarray(y)
    # Integer labels of any shape as int32 (class ids (n,) hash exactly as they always did);
    # floating-point labels (regression targets, soft multi-label) as float32, tagged.
    y_tag = b"" if np.issubdtype(y.dtype, np.integer) else b"label-float32:"
    y = np.ascontiguousarray(y, dtype=np.float32 if y_tag else np.int32)
    y = y.reshape(len(y), int(np.prod(y.shape[1:])))  # also for n = 0
    out = np.empty(len(x), dtype=object)
    for i in range(len(x)):
        h = hashlib.sha256(b"int64:" if integer else b"")
        h.update(x[i].tobytes())
        h.update(y_tag + y[i].tobytes())
        out[i] = h.digest()
    return out


def record_split_uniforms(digests: np.ndarray, seed_split: int = 0) -> np.ndarray:
    """One number in [0, 1) per record: a keyed hash (BLAKE2b, public key ``SPLIT_KEY`` and
    ``seed_split``) of the record's digest. A record goes to validation iff its number is below the
    validation fraction, so its split depends on that record alone: adding or removing a record
    never moves another (the premise of DP-SGD's add/remove guarantee and of the parallel
    composition of training with the noisy validation count)."""
    key = SPLIT_KEY + b"/" + str(int(seed_split)).encode()
    u = np.empty(len(digests), dtype=np.float64)
    for i, d in enumerate(digests):
        word = int.from_bytes(hashlib.blake2b(d, key=key, digest_size=8).digest(), "big")
        u[i] = word / 2.0**64
    return u


def record_subset_mask(digests: np.ndarray, fraction: float, key: bytes) -> np.ndarray:
    """Poisson subsampling by record: True for the records in a random subset with rate
    ``fraction``, drawn per record from a SECRET ``key`` (e.g. 32 bytes of OS entropy).

    Record i is in the subset iff BLAKE2b(key; its digest, c) / 2^64 < ``fraction``, where c
    counts the earlier records with the same digest (identical records are distinct people, so
    each copy gets its own draw: the first copy's draw is never shared with a second). Adding or
    removing one record therefore changes only that record's membership (removing one of several
    identical copies removes the last copy's draw; the copies are interchangeable). With the key
    secret and modelled as a random function, memberships are independent Bernoulli(``fraction``)
    draws: the Poisson subsampling that privacy amplification by subsampling assumes (Balle,
    Barthe & Gaboardi 2018, Thm 8).

    Args:
      digests: ``record_digests`` of the records, shape (n,).
      fraction: the subsampling rate, in (0, 1].
      key: the secret key (bytes, 16 to 64 long: BLAKE2b's key limit is 64).
    Returns:
      A bool array of shape (n,).
    """
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(f"fraction={fraction!r} must be in (0, 1]")
    if not isinstance(key, bytes) or not 16 <= len(key) <= 64:
        raise ValueError("key must be 16 to 64 secret bytes")
    seen: dict[bytes, int] = {}
    out = np.empty(len(digests), dtype=bool)
    for i, d in enumerate(digests):
        c = seen.get(d, 0)
        seen[d] = c + 1
        h = hashlib.blake2b(d + c.to_bytes(8, "big"), key=key, digest_size=8).digest()
        out[i] = int.from_bytes(h, "big") / 2.0**64 < fraction
    return out


def multiset_fingerprint(digests: Sequence[bytes]) -> str:
    """sha256 (hex) of the sorted record digests: the records as a multiset, independent of their
    order and of any split (the ledger's dataset id)."""
    h = hashlib.sha256(b"dptune/records/v1")
    for d in sorted(digests):
        h.update(d)
    return h.hexdigest()


#: Largest integer magnitude a float32 holds exactly (2^24): the integer fields of a dict input
#: stored beside floating-point fields (``InputLayout``) must stay below it.
_FLOAT32_EXACT_INT = 2**24


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """How a dict of input arrays sharing the record axis is stored as one array (n, width).

    Each field's per-record values are flattened and laid side by side, in the dict's key order.
    Storage is int32 when every field is integer, else float32 (integer fields then hold exact
    integers below 2^24 in magnitude: token ids, lengths). Public: it depends on the fields'
    shapes and dtypes only. ``unpack`` rebuilds the dict the model is called with (NumPy or JAX
    arrays, any leading axes).

    Attributes:
      fields: (key, per-record shape, dtype name) per field, in order.
      dtype: the storage dtype name ("float32" or "int32").
    """

    fields: tuple[tuple[str, tuple[int, ...], str], ...]
    dtype: str

    @classmethod
    def of(cls, x: dict) -> InputLayout:
        fields = []
        for key, a in x.items():
            a = _as_inputs(a, f"x[{key!r}]", min_ndim=1)
            fields.append((str(key), tuple(a.shape[1:]), a.dtype.name))
        integer = all(np.issubdtype(np.dtype(d), np.integer) for _, _, d in fields)
        return cls(tuple(fields), "int32" if integer else "float32")

    @property
    def width(self) -> int:
        return sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in self.fields)

    def pack(self, x: dict, what: str = "x") -> np.ndarray:
        """The fields of ``x`` (same keys, shapes and dtype kinds as the layout's) as (n, width)."""
        if not isinstance(x, dict) or [str(k) for k in x] != [k for k, _, _ in self.fields]:
            got = list(x) if isinstance(x, dict) else type(x).__name__
            raise ValueError(
                f"dptune: {what} must be a dict with keys {[k for k, _, _ in self.fields]} (the "
                f"same as x's, in the same order), got {got}"
            )
        parts, n = [], None
        for (key, shape, dtype), a in zip(self.fields, x.values(), strict=True):
            a = _as_inputs(a, f"{what}[{key!r}]", min_ndim=1)
            if tuple(a.shape[1:]) != shape or a.dtype.name != dtype:
                raise ValueError(
                    f"dptune: {what}[{key!r}] records are {a.dtype}{a.shape[1:]}, but x's are "
                    f"{dtype}{shape}"
                )
            if n is not None and len(a) != n:
                raise ValueError(
                    f"dptune: the arrays of {what} must share the record axis: {what}[{key!r}] "
                    f"has {len(a)} records, the others {n}"
                )
            n = len(a)
            parts.append(a.reshape(len(a), -1).astype(self.dtype))
        return np.ascontiguousarray(np.concatenate(parts, axis=1))

    def too_large(self, x: dict) -> np.ndarray:
        """Per record: whether an integer field holds a value float32 storage cannot keep exact
        (|v| >= 2^24; never with int32 storage). A per-record rule (the record alone decides)."""
        n = len(next(iter(x.values())))
        bad = np.zeros(n, dtype=bool)
        if self.dtype == "int32":
            return bad
        for (_, _, dtype), a in zip(self.fields, x.values(), strict=True):
            if np.issubdtype(np.dtype(dtype), np.integer):
                a = np.abs(np.asarray(a, np.int64).reshape(n, -1))
                bad |= (a >= _FLOAT32_EXACT_INT).any(axis=1)
        return bad

    def unpack(self, x):
        """The dict the model reads from stored inputs ``x`` (..., width): each field reshaped to
        (..., *its shape) in its dtype (NumPy or JAX arrays alike)."""
        out, lo = {}, 0
        lead = tuple(x.shape[:-1])
        for key, shape, dtype in self.fields:
            hi = lo + int(np.prod(shape, dtype=np.int64))
            v = x[..., lo:hi].reshape(lead + shape)
            if dtype != self.dtype:
                # An integer field in float32 storage: exact integers; round() maps the synthetic
                # probes' real values onto integers too.
                v = v.round() if np.issubdtype(np.dtype(dtype), np.integer) else v
                v = v.astype(dtype)
            out[key] = v
            lo = hi
        return out

    def describe(self) -> list:
        """JSON-safe: [[key, shape, dtype], ...]."""
        return [[k, list(shape), d] for k, shape, d in self.fields]


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """In-memory dataset split into train / validation / test.

    Attributes:
      train_x, val_x, test_x: the inputs, (n, ...): float32 images (n, height, width, channels) in
        [0, 1] from the loaders; any shape and dtype (float32 features, int32 token ids, ...) from
        :meth:`from_arrays`.
      train_y, val_y, test_y: labels with a leading record axis: int32 class ids (n,) in [0,
        num_classes) from the loaders; from :meth:`from_arrays` any shape (n, ...), int32
        (class ids, multi-label or next-token ids) or float32 (regression targets, soft labels).
      num_classes: number of classes; 0 when the labels are not class ids (float labels, or
        integer labels of shape (n, ...) declared without ``num_classes``).
      name: dataset name (one of ``NAMES``, or the user's name for :meth:`from_arrays`).
      public_num_train: the public nominal number of training examples: DP-SGD's sampling rate is
        ``batch_size / public_num_train`` and its step count ``epochs * ceil(public_num_train /
        batch_size)``, whatever the private arrays' length (which is never used for privacy).
      public_num_val: the public expected validation size: the noisy validation score divides the
        noisy correct count by it (a public constant, so the count's sensitivity stays 1).
      validation_public: True only when the validation split was declared public and separate from
        the private data; only then may a candidate be scored exactly.
      split: how train/validation were formed (JSON-safe), for the privacy statement:
        ``{"kind": "record_hash", ...}`` (each record's split is a keyed hash of that record) or
        ``{"kind": "separate_files", ...}`` (validation supplied separately).
      sanitized: how many private records the loader dropped, by reason
        (``drop_invalid_records``); PRIVATE counts, for the curator's view only, never released.
      input_layout: for a dict input (:meth:`from_arrays`), how its fields are stored in the
        (n, width) arrays ``*_x`` (:class:`InputLayout`); the model is called with the dict.
    """

    train_x: np.ndarray
    train_y: np.ndarray
    val_x: np.ndarray
    val_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    name: str
    public_num_train: int = 0
    public_num_val: float = 0.0
    validation_public: bool = False
    split: dict = dataclasses.field(default_factory=dict)
    sanitized: dict = dataclasses.field(default_factory=dict)
    input_layout: InputLayout | None = None

    @property
    def class_labels(self) -> bool:
        """Whether the labels are integer class ids of shape (n,) (what the default loss,
        softmax cross-entropy, and the default metric, accuracy, read)."""
        return self.train_y.ndim == 1 and np.issubdtype(self.train_y.dtype, np.integer)

    def __post_init__(self) -> None:
        # Datasets built by hand (tests, users) without public sizes get the arrays' sizes: the
        # caller then declares them public by construction. The loaders always set them.
        if not self.public_num_train:
            object.__setattr__(self, "public_num_train", int(len(self.train_x)))
        if not self.public_num_val:
            object.__setattr__(self, "public_num_val", float(len(self.val_x)))
        if not self.split:
            object.__setattr__(self, "split", {"kind": "given"})

    def fingerprint(self) -> str:
        """The private records as a multiset (sha256 of the sorted per-record digests): training
        records, plus validation records unless the validation split is public. Independent of
        the records' order, of the split, its seed and the validation size, so every run on the
        same people is charged to the same ledger budget."""
        parts = [record_digests(self.train_x, self.train_y)]
        if not self.validation_public:
            parts.append(record_digests(self.val_x, self.val_y))
        return multiset_fingerprint(np.concatenate(parts))

    @property
    def image_shape(self) -> tuple[int, ...]:
        """Shape of one example's input ((height, width, channels) for images)."""
        return tuple(self.train_x.shape[1:])

    @classmethod
    def from_arrays(
        cls, x: np.ndarray | dict[str, np.ndarray], y: np.ndarray, *,
        num_examples: int | None = None, validation_fraction: float = 0.1,
        x_test: np.ndarray | None = None, y_test: np.ndarray | None = None,
        public_validation: tuple[np.ndarray, np.ndarray] | None = None,
        num_classes: int | None = None, name: str = "arrays", seed_split: int = 0,
    ) -> Dataset:  # fmt: skip
        """A dataset from in-memory arrays of any shape: images (n, h, w, c), tabular rows (n, d),
        token ids (n, length), ...

        The records of (x, y) are the private data. Each goes to validation by a keyed hash of the
        record itself, with probability ``validation_fraction`` (``split_validation``: adding or
        removing one record moves no other). Privacy uses public sizes only (docs/privacy-model.md):
        DP-SGD's sampling rate and step count come from ``num_examples`` minus the expected
        validation size, never from ``len(x)``.

        Args:
          x: inputs (n, ...), or a dict of arrays sharing the record axis (e.g. ``{"tokens":
            (n, L) ids, "length": (n,)}``), which the model receives as that dict (stored as
            one (n, width) array, :class:`InputLayout`). Floating-point inputs are stored as
            float32, integer inputs as int32.
          y: labels with a leading record axis: integer class ids (n,) (the default loss and
            metric read these), or any (n, ...) array with your own ``loss=`` and ``metric=``:
            float regression targets (n,) or (n, k), multi-label (n, k), next-token ids (n, L)
            (a sequence is one record). Integer labels are stored as int32, others as float32;
            strings are refused (encode them as integer ids).
          num_examples: the PUBLIC number of records in (x, y), declared by you (required: the
            length of the private arrays changes when one person is added or removed). Arrays
            more than 1% away from it get a warning on the curator's console (a guard against a
            wrong declaration; never a refusal, which would depend on the private data).
          validation_fraction: expected fraction of the records that go to the (private)
            validation split, in [0, 1); ignored with ``public_validation``.
          x_test, y_test: a public test split, only for reporting (not covered by the guarantee).
          public_validation: (x_val, y_val), a validation set that is public and separate from
            the private records; then (x, y) is not split, and candidates may be scored exactly.
          num_classes: the number of classes (public). Default: read from the public labels
            (test or public validation), never the private ones; required without them for class
            labels (n,); 0 for other labels, where a given value bounds integer labels of any
            shape (e.g. a vocabulary size).
          name: a label for reports and the ledger.
          seed_split: public seed of the split hash.

        Private records with an integer label outside [0, num_classes), a non-finite float label,
        a NaN or infinite feature, or (dict inputs stored as float32) an integer field of
        magnitude >= 2^24 are dropped, each on its own (a refusal would depend on the private
        records), with a warning on the curator's console and the private counts in
        ``sanitized``. Such public records (``x_test``, ``public_validation``) are refused.

        Raises:
          ValueError: a missing or malformed ``num_examples``; shapes or dtypes that do not match
            (a dict's fields; public records against x's and y's); string labels; a validation
            fraction outside [0, 1); class labels (n,) with no public ``num_classes``.
        """
        x, y, layout, too_large = _private_records(x, y, num_examples)
        num_classes = _public_num_classes(y, num_classes, y_test, public_validation)
        x, y, dropped = _drop_unusable(x, y, too_large, num_classes, name)
        public = functools.partial(_public_records, x, y, layout, num_classes)
        x_test, y_test = public(x_test, y_test, "x_test", "y_test")
        check_declared_size(len(x), num_examples, name)
        if public_validation is not None:
            val_x, val_y = public(
                *public_validation, "public_validation", "public_validation labels"
            )
            if not len(val_x):
                raise ValueError("public_validation holds no records")
            data = cls(
                train_x=x, train_y=y, val_x=val_x, val_y=val_y, test_x=x_test, test_y=y_test,
                num_classes=num_classes, name=name, public_num_train=int(num_examples),
                public_num_val=float(len(val_x)), validation_public=True,
                split={"kind": "separate_files", "validation_public": True},
            )  # fmt: skip
        elif not 0 <= validation_fraction < 1:
            raise ValueError(f"validation_fraction={validation_fraction!r} must be in [0, 1)")
        else:
            data = split_validation(
                x, y, x_test, y_test, num_classes, name, validation_fraction * num_examples,
                seed_split, num_examples=num_examples,
            )  # fmt: skip
        return dataclasses.replace(data, input_layout=layout, sanitized=dropped)

    def describe_split(self) -> str:
        """One sentence for the privacy statement: how the validation split was formed."""
        s = self.split
        if s.get("kind") == "record_hash":
            return (
                f"train/validation split per record (keyed hash of each record, public key "
                f"{s['key']!r}, seed {s['seed']}; validation fraction {s['fraction']:.6g} of the "
                f"declared {s['num_examples']} records): adding or removing a record moves no "
                "other record"
            )
        if s.get("kind") == "separate_files":
            public = "public" if self.validation_public else "private"
            return f"validation split supplied separately ({public})"
        return "train/validation split given by the caller"

    def __repr__(self) -> str:  # arrays are large: show shapes only
        return (
            f"Dataset(name={self.name!r}, train={self.train_x.shape}, val={self.val_x.shape}, "
            f"test={self.test_x.shape}, num_classes={self.num_classes})"
        )


def _private_records(
    x: np.ndarray | dict[str, np.ndarray], y: np.ndarray, num_examples: int | None
) -> tuple[np.ndarray, np.ndarray, InputLayout | None, np.ndarray]:
    """``Dataset.from_arrays``' private records as stored: (x (n, ...) or a dict input packed to
    (n, width), y (n, ...), the dict's layout or None, (n,) bool: a dict record with an integer
    field too large for exact float32 storage). Refuses what is wrong whatever the records hold."""
    if num_examples is None:
        raise ValueError(
            "Dataset.from_arrays needs num_examples=<the public number of records in x>: "
            "DP-SGD's sampling rate and step count must not depend on the private arrays' "
            "length, which changes when one person is added or removed. Declare the size "
            "you would publish (e.g. the size of the file as documented)"
        )
    layout = None
    if isinstance(x, dict):
        if not x:
            raise ValueError("dptune: x is an empty dict: give at least one input array")
        layout = InputLayout.of(x)
        too_large = layout.too_large({k: np.asarray(v) for k, v in x.items()})
        x = layout.pack(x)
    else:
        x = _as_inputs(x, "x")
        too_large = np.zeros(len(x), dtype=bool)
    y = _as_labels(y, "y")
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} records but y has {len(y)} labels")
    return x, y, layout, too_large


def _public_num_classes(
    y: np.ndarray, num_classes: int | None, y_test: np.ndarray | None, public_validation
) -> int:
    """``num_classes`` as given, else read from the PUBLIC labels (test or public validation),
    never from the private ``y``; 0 for labels that are not class ids (n,) given without it."""
    if num_classes is None and y.ndim == 1 and np.issubdtype(y.dtype, np.integer):
        public_labels = [a for a in (y_test, None if public_validation is None else
                                     public_validation[1]) if a is not None]  # fmt: skip
        if not public_labels or not any(len(a) for a in public_labels):
            raise ValueError(
                "Dataset.from_arrays needs num_classes=... (public): with no public labels "
                "(x_test/y_test or public_validation) it cannot be read from the data "
                "without looking at the private labels"
            )
        num_classes = int(max(int(np.max(a)) for a in public_labels if len(a))) + 1
    return 0 if num_classes is None else int(num_classes)


def _drop_unusable(
    x: np.ndarray, y: np.ndarray, too_large: np.ndarray, num_classes: int, name: str
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """The private records without those with a bad label, a ``too_large`` integer field or a
    non-finite feature, and ``{reason: number dropped}`` (PRIVATE counts: the curator's view
    only). Each record alone decides whether it is kept (a stable transformation, as in
    ``drop_invalid_records``), with a warning on the curator's console per reason."""
    bad_label = _bad_labels(y, num_classes)
    too_large = too_large & ~bad_label
    non_finite = ~finite_records(x) & ~bad_label & ~too_large
    dropped: dict[str, int] = {}
    for key, bad, why in (
        (DROP_LABEL, bad_label, f"a label outside [0, {num_classes}) (num_classes)"
         if np.issubdtype(y.dtype, np.integer) else "a non-finite label"),
        (DROP_LARGE_INT, too_large, "an integer input field of magnitude >= 2^24 (float32 "
         "storage beside floating-point fields keeps integers exact below it)"),
        (DROP_FEATURES, non_finite, "a feature that is NaN or infinite"),
    ):  # fmt: skip
        if bad.any():
            dropped[key] = int(bad.sum())
            log.warning("%d records of %r have %s: they are left out", dropped[key], name, why)
    keep = ~(bad_label | too_large | non_finite)
    if not keep.all():
        x, y = x[keep], y[keep]
    return x, y, dropped


def _public_records(
    x: np.ndarray, y: np.ndarray, layout: InputLayout | None, num_classes: int, xs, ys,
    what: str, ywhat: str,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Public records (``x_test``, ``public_validation``) stored like the private ``x``, ``y``;
    empty arrays shaped like them when ``xs`` is None. Checking public records reveals nothing
    private, so malformed ones are refused, not filtered."""
    if xs is None:
        if ys is not None:
            raise ValueError(f"{ywhat} given without {what}")
        return np.zeros_like(x[:0]), np.zeros_like(y[:0])
    if layout is not None:
        if isinstance(xs, dict) and layout.too_large(xs).any():
            raise ValueError(f"dptune: {what} holds integers of magnitude >= 2^24")
        xs = layout.pack(xs, what)
    else:
        xs = _as_inputs(xs, what)
        _same_record_shape(x, xs, what)
    _refuse_non_finite(xs, what)
    ys = _as_labels(ys, ywhat)
    if ys.shape[1:] != y.shape[1:] or ys.dtype != y.dtype:
        raise ValueError(
            f"dptune: {ywhat} are {ys.dtype}{ys.shape[1:]} per record, but y's are "
            f"{y.dtype}{y.shape[1:]}"
        )
    if len(xs) != len(ys):
        raise ValueError(f"dptune: {what} has {len(xs)} records but {len(ys)} labels")
    if _bad_labels(ys, num_classes).any():
        raise ValueError(
            f"{ywhat} must be integers in [0, {num_classes}) (num_classes)"
            if np.issubdtype(ys.dtype, np.integer)
            else f"{ywhat} must be finite"
        )
    return xs, ys


def subset_dataset(data: Dataset, fraction: float, key: bytes) -> Dataset:
    """The records of ``data`` in a per-record Poisson subset (``record_subset_mask`` over the
    training and validation records together, each keeping its split), with public sizes scaled
    by ``fraction`` (expected sizes: public, whatever the subset's actual length). The public test
    split is kept whole (it is only for reporting).
    """
    digests = record_digests(
        np.concatenate([data.train_x, data.val_x]), np.concatenate([data.train_y, data.val_y])
    )
    mask = record_subset_mask(digests, fraction, key)
    n_train = len(data.train_x)
    keep_train, keep_val = mask[:n_train], mask[n_train:]
    return dataclasses.replace(
        data,
        train_x=np.ascontiguousarray(data.train_x[keep_train]),
        train_y=np.ascontiguousarray(data.train_y[keep_train]),
        val_x=np.ascontiguousarray(data.val_x[keep_val]),
        val_y=np.ascontiguousarray(data.val_y[keep_val]),
        public_num_train=max(1, round(fraction * data.public_num_train)),
        public_num_val=fraction * data.public_num_val,
        split={**data.split, "subset_fraction": float(fraction)},
    )


def load_dataset(
    name: str,
    data_dir: str | os.PathLike | None = None,
    validation_size: int = 5000,
    source: str = "auto",
    seed_split: int = 0,
    *,
    num_examples: int | None = None,
    validation_dir: str | os.PathLike | None = None,
    validation_public: bool = False,
) -> Dataset:
    """Loads ``name`` and splits its training file into training and validation records.

    Each record goes to validation by a keyed hash of the record itself (``record_split_uniforms``)
    with probability ``validation_size / num_examples``, so the split of one record never depends
    on the others. Sizes used for privacy are public: ``num_examples`` (default: the published
    size of ``name``) and the *expected* ``validation_size``.

    Args:
      name: "mnist", "fashion_mnist", "cifar10" or "synthetic".
      data_dir: a local folder (IDX layout, CIFAR-10 pickle layout) or a TFDS data_dir.
      validation_size: expected number of training-file records in the validation split (public).
      source: "auto" (a local folder if ``data_dir`` holds one, else TFDS), "tfds", "idx",
        "cifar_pickle", "synthetic".
      seed_split: public seed of the split hash (a different seed is a different split of the same
        people; the ledger charges both to one budget).
      num_examples: the public number of records in the training file (default
        ``PUBLISHED_TRAIN_SIZES[name]``); loading warns if the file holds more than
        ``SIZE_TOLERANCE`` more or fewer.
      validation_dir: an IDX folder whose ``train-*`` files hold a separately supplied validation
        set; then the training file is not split and the statement says so.
      validation_public: declare the separate validation set public (not private data): only then
        may candidates be scored exactly (``score_noise_std=None``).

    Raises:
      DatasetNotFoundError: the data is not there; the message says how to point at local files.
      ValueError: an unknown name/source, an impossible validation size, or
        ``validation_public`` without a separate validation set.
    """
    if name not in NAMES:
        raise ValueError(f"unknown dataset name {name!r}; expected one of {NAMES}")
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")
    if validation_public and validation_dir is None:
        raise ValueError(
            "validation_public=True needs a separate validation set (validation_dir=...): a "
            "validation split cut from the private training file is private"
        )
    name, declared, (train_x, train_y, test_x, test_y) = _read_named(
        name, data_dir, source, num_examples
    )
    num_classes = 10  # every named dataset
    check_public_split(test_x, test_y, num_classes, f"the {name!r} test split")
    test_y = np.asarray(test_y).astype(np.int32)
    check_declared_size(len(train_x), declared, name)  # the file's records, as declared
    train_x, train_y, dropped = drop_invalid_records(train_x, train_y, num_classes)
    if validation_dir is not None:
        val_x, val_y, _, _ = _load_idx(_require_dir(name, validation_dir), test_files=False)
        val_x, val_y, val_dropped = drop_invalid_records(val_x, val_y, num_classes)
        if not validation_public:  # a public validation set's counts would be public anyway
            dropped = {
                k: dropped.get(k, 0) + val_dropped.get(k, 0) for k in {*dropped, *val_dropped}
            }
        return Dataset(
            train_x=train_x, train_y=train_y, val_x=val_x, val_y=val_y, test_x=test_x,
            test_y=test_y, num_classes=num_classes, name=name, public_num_train=int(declared),
            public_num_val=float(len(val_x) if validation_public else validation_size),
            validation_public=bool(validation_public),
            split={"kind": "separate_files", "validation_public": bool(validation_public)},
            sanitized=dropped,
        )  # fmt: skip
    data = split_validation(
        train_x, train_y, test_x, test_y, num_classes, name, validation_size, seed_split,
        num_examples=declared,
    )  # fmt: skip
    return dataclasses.replace(data, sanitized=dropped) if dropped else data


def _read_named(
    name: str, data_dir, source: str, num_examples: int | None
) -> tuple[str, int, tuple[np.ndarray, ...]]:
    """(name, declared public size of the training file, (train_x, train_y, test_x, test_y)) of
    a named dataset from its ``source`` ("auto": a local folder if ``data_dir`` holds one, else
    TFDS). The synthetic data's declared size defaults to its length."""
    if name == "synthetic" or source == "synthetic":
        arrays = _synthetic_arrays()[:4]
        return "synthetic", len(arrays[0]) if num_examples is None else num_examples, arrays
    if source == "auto":
        source = _detect_source(name, data_dir)
    if source == "idx":
        arrays = _load_idx(_require_dir(name, data_dir))
    elif source == "cifar_pickle":
        arrays = _load_cifar_pickle(_require_dir(name, data_dir))
    else:
        arrays = _load_tfds(name, data_dir)
    return name, PUBLISHED_TRAIN_SIZES[name] if num_examples is None else num_examples, arrays


#: Why ``drop_invalid_records`` drops a record (the keys of ``Dataset.sanitized``).
DROP_LABEL = "label_out_of_range"
DROP_FEATURES = "non_finite_features"
#: ``Dataset.from_arrays``: a dict input's integer field too large for exact float32 storage.
DROP_LARGE_INT = "integer_field_too_large"


def invalid_records(x: np.ndarray, y: np.ndarray, num_classes: int) -> dict[str, np.ndarray]:
    """Boolean masks (shape (n,)) of the records with a label that is not an integer in
    ``[0, num_classes)`` and of those with a non-finite feature. Each record's entries depend on
    that record alone."""
    y = np.asarray(y)
    x = np.asarray(x)
    n = len(y)
    if np.issubdtype(y.dtype, np.integer):
        bad_label = (y < 0) | (y >= num_classes)
    else:
        yf = y.astype(np.float64, copy=False)
        with np.errstate(invalid="ignore"):
            bad_label = ~np.isfinite(yf) | (yf != np.round(yf)) | (yf < 0) | (yf >= num_classes)
    return {DROP_LABEL: bad_label.reshape(n), DROP_FEATURES: ~finite_records(x)}


def finite_records(x: np.ndarray) -> np.ndarray:
    """(n,) bool: whether every feature of record i of ``x`` (n, ...) is finite (integer inputs
    always are). Record i's entry depends on record i alone."""
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.complexfloating):
        return np.isfinite(x.reshape(len(x), int(np.prod(x.shape[1:])))).all(axis=1)
    return np.ones(len(x), dtype=bool)


def _refuse_non_finite(x: np.ndarray, what: str) -> None:
    """Refuses a PUBLIC array with a NaN or infinite feature, naming it and the first records
    (public: saying which reveals nothing private); ValueError."""
    bad = ~finite_records(x)
    if bad.any():
        raise ValueError(
            f"{what} has {int(bad.sum())} record(s) with a NaN or infinite feature, e.g. records "
            f"{np.flatnonzero(bad)[:5].tolist()}: fix or remove them (public data is refused, "
            "not filtered)"
        )


def drop_invalid_records(
    x: np.ndarray, y: np.ndarray, num_classes: int
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Drops the private records whose label is not an integer in ``[0, num_classes)`` or whose
    features are not all finite; returns ``(x, y as int32, {reason: number dropped})``.

    Whether a record is kept depends on that record alone (a stable transformation, like PINQ's
    ``Where`` or OpenDP's filtering: McSherry 2009, Thm 3 with stability 1), so adding or removing
    one person changes the kept records by at most that person's record, and every guarantee of
    what is computed from them holds for the original data with the same adjacency. The counts
    are private (they count people's records): for the curator's view only, never released.
    Shapes: ``x`` (n, ...), ``y`` (n,); call it on user arrays before any private computation.
    """
    if len(x) != len(y):
        raise ValueError(f"{len(x)} feature rows but {len(y)} labels: give one label per record")
    masks = invalid_records(x, y, num_classes)
    bad = np.zeros(len(y), dtype=bool)
    counts: dict[str, int] = {}
    for reason, mask in masks.items():
        counts[reason] = int(np.sum(mask & ~bad))  # each dropped record counted once
        bad |= mask
    keep = ~bad
    if bad.any():
        x, y = x[keep], y[keep]
    return (
        np.ascontiguousarray(x),
        np.asarray(y).astype(np.int32),
        {k: v for k, v in counts.items() if v},
    )


def check_public_split(x: np.ndarray, y: np.ndarray, num_classes: int, what: str) -> None:
    """Refuses a public split (the test split) with malformed records, saying how many and which
    (it is public: nothing private is revealed); ValueError."""
    if len(x) != len(y):
        raise ValueError(f"{what}: {len(x)} images but {len(y)} labels")
    for reason, mask in invalid_records(x, y, num_classes).items():
        if mask.any():
            first = np.flatnonzero(mask)[:5].tolist()
            raise ValueError(
                f"{what} has {int(mask.sum())} record(s) with {reason.replace('_', ' ')} "
                f"(labels must be integers in [0, {num_classes})), e.g. records {first}: fix or "
                "remove them (the test split is public, so it is refused, not filtered)"
            )


def check_declared_size(actual: int, declared: int, name: str) -> None:
    """Warns (on the curator's console) when the record count is far from the declared public
    size: a guard against declaring the wrong size. Never a refusal: whether the private file
    holds more than ``SIZE_TOLERANCE`` more or fewer records than declared depends on the private
    data, and a refusal of one neighbour but not the other would release it. The
    guarantee uses only the declared size."""
    if isinstance(declared, bool) or not isinstance(declared, (int, np.integer)) or declared < 1:
        shape = getattr(declared, "shape", ())  # the data itself: never print its values
        shown = f"<array of shape {tuple(shape)}>" if shape else repr(declared)
        raise ValueError(f"num_examples={shown} must be a positive integer: the PUBLIC size")
    if abs(actual - declared) > SIZE_TOLERANCE * declared:
        log.warning(
            "the %r training file holds %d records, far from the declared public size %d (more "
            "than %.0f%% off). Sampling rates and step counts come from the declared size: if it "
            "is wrong, declare the right one (num_examples=..., config data.num_examples)",
            name,
            actual,
            declared,
            100 * SIZE_TOLERANCE,
        )


def split_validation(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    num_classes: int,
    name: str,
    validation_size: float,
    seed_split: int = 0,
    *,
    num_examples: int | None = None,
) -> Dataset:
    """Splits the training file by record: record i goes to validation iff its keyed hash is below
    ``validation_size / num_examples`` (``num_examples``: the public size of the file; default its
    length, for data the caller made). Public sizes: ``num_examples - validation_size`` training
    (rounded down: ``int``) and ``validation_size`` validation records expected.
    ``validation_size``: an integer, or any expected size (a float, ``fraction * num_examples``)."""
    declared = int(len(train_x) if num_examples is None else num_examples)
    if (
        isinstance(validation_size, bool)
        or not isinstance(validation_size, (int, np.integer, float))
        or not 0 <= validation_size < declared
    ):
        raise ValueError(
            f"validation_size={validation_size!r} must be a number >= 0 and smaller than the "
            f"{declared} training examples"
        )
    fraction = validation_size / declared
    u = record_split_uniforms(record_digests(train_x, train_y), seed_split)
    in_val = u < fraction
    return Dataset(
        train_x=np.ascontiguousarray(train_x[~in_val]),
        train_y=np.ascontiguousarray(train_y[~in_val]),
        val_x=np.ascontiguousarray(train_x[in_val]),
        val_y=np.ascontiguousarray(train_y[in_val]),
        test_x=test_x,
        test_y=test_y,
        num_classes=num_classes,
        name=name,
        public_num_train=int(declared - validation_size),
        public_num_val=float(validation_size),
        validation_public=False,
        split={
            "kind": "record_hash",
            "key": SPLIT_KEY.decode(),
            "seed": int(seed_split),
            "fraction": fraction,
            "num_examples": declared,
        },
    )


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file with keys ``x_train``, ``y_train`` and optionally ``x_test``,
    ``y_test`` (``numpy.savez``). Raises DatasetNotFoundError / ValueError naming what is wrong."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetNotFoundError(f"no npz file at {str(path)!r}")
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: np.asarray(f[k]) for k in f.files}
    return check_arrays(arrays, str(path))


def check_arrays(arrays: dict, where: str) -> dict[str, np.ndarray]:
    """``arrays`` restricted to ``ARRAY_KEYS``: x_train and y_train required, x_test and y_test
    together or not at all."""
    missing = [k for k in ("x_train", "y_train") if k not in arrays]
    if missing:
        raise ValueError(f"{where} lacks {missing} (keys: {sorted(arrays)}; expected {ARRAY_KEYS})")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise ValueError(f"{where}: give both x_test and y_test, or neither")
    return {k: np.asarray(arrays[k]) for k in ARRAY_KEYS if k in arrays}


def _as_inputs(x: np.ndarray, what: str, min_ndim: int = 2) -> np.ndarray:
    """Inputs as float32 (floating point) or int32 (integer ids), contiguous; at least
    ``min_ndim``-D (a dict input's fields may be one value per record, (n,))."""
    x = np.asarray(x)
    if x.ndim < min_ndim:
        raise ValueError(f"{what} has shape {x.shape}: expected (records, ...) with a feature axis")
    if np.issubdtype(x.dtype, np.floating) or x.dtype == bool:
        return np.ascontiguousarray(x, dtype=np.float32)
    if np.issubdtype(x.dtype, np.integer):
        return np.ascontiguousarray(x, dtype=np.int32)
    raise ValueError(f"{what} has dtype {x.dtype}: expected floating-point or integer inputs")


def _as_labels(y: np.ndarray, what: str) -> np.ndarray:
    """Labels with a leading record axis: int32 (integers), float32 (floating point, bool)."""
    y = np.asarray(y)
    if y.dtype.kind in "USO":
        raise ValueError(
            f"dptune: {what} holds {y.dtype} labels: encode them as integer ids first, e.g. "
            "classes, y = np.unique(y, return_inverse=True) (keep `classes` to decode "
            "predictions), and pass the integer array"
        )
    if y.ndim < 1:
        raise ValueError(f"dptune: {what} has shape {y.shape}: expected (records, ...)")
    if np.issubdtype(y.dtype, np.integer):
        return np.ascontiguousarray(y, dtype=np.int32)
    if np.issubdtype(y.dtype, np.floating) or y.dtype == bool:
        return np.ascontiguousarray(y, dtype=np.float32)
    raise ValueError(f"dptune: {what} has dtype {y.dtype}: expected integer or float labels")


def _bad_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    """Per record: an integer label (any element) outside [0, num_classes) when num_classes > 0,
    or a non-finite float label. Shape (n,)."""
    rows = y.reshape(len(y), int(np.prod(y.shape[1:])))  # also for n = 0
    if np.issubdtype(y.dtype, np.integer):
        if num_classes <= 0:
            return np.zeros(len(y), dtype=bool)
        return ((rows < 0) | (rows >= num_classes)).any(axis=1)
    return ~np.isfinite(rows).all(axis=1)


def _same_record_shape(x: np.ndarray, other: np.ndarray, what: str) -> None:
    if other.shape[1:] != x.shape[1:] or other.dtype != x.dtype:
        raise ValueError(
            f"{what} records are {other.dtype}{other.shape[1:]}, but x's are {x.dtype}{x.shape[1:]}"
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

    ``num_train`` counts the training-file records before the per-record split (``validation_size``
    of them expected in validation).
    """
    train_x, train_y, test_x, test_y, _ = _synthetic_arrays(
        num_train, num_test, image_shape, num_classes, noise, seed
    )
    return split_validation(
        train_x, train_y, test_x, test_y, num_classes, "synthetic", validation_size, seed
    )


def _synthetic_arrays(
    num_train: int = 10000, num_test: int = 2000, image_shape: tuple = (28, 28, 1),
    num_classes: int = 10, noise: float = 0.3, seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:  # fmt: skip
    """(train_x, train_y, test_x, test_y, num_classes): float32 images in [0, 1], int32 labels;
    the defaults are the "synthetic" dataset of :func:`load_dataset`."""
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

    return (*draw(num_train), *draw(num_test), num_classes)


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
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt .gz
        raise ValueError(
            f"{path} cannot be read ({type(e).__name__}: {e}): is it complete?"
        ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (magic bytes {raw[:4]!r})")
    ndim = raw[3]
    if ndim < 1 or len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: its IDX header is cut short ({len(raw)} bytes)")
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says shape {tuple(dims)} but holds {data.size} bytes")
    return data.reshape(tuple(dims))


def _load_idx(folder: Path, test_files: bool = True):
    keys = [k for k in _IDX_FILES if test_files or k.startswith("train")]
    paths = {k: _find_idx(folder, k) for k in keys}
    missing = [_IDX_FILES[k][0] for k, p in paths.items() if p is None]
    if missing:
        raise DatasetNotFoundError(f"{str(folder)!r} lacks IDX files {missing}. {_HOW_TO_POINT}")
    arrays = {k: _read_idx(p) for k, p in paths.items()}
    for kind in ("train", "test") if test_files else ("train",):
        x, y = arrays[f"{kind}_x"], arrays[f"{kind}_y"]
        if x.ndim != 3:
            raise ValueError(
                f"{paths[kind + '_x']} holds an array of shape {x.shape}; images in the IDX layout "
                "have shape (n, height, width)"
            )
        if y.ndim != 1:
            raise ValueError(
                f"{paths[kind + '_y']} holds an array of shape {y.shape}; labels have shape (n,)"
            )
        if len(x) != len(y):
            raise ValueError(
                f"{paths[kind + '_x']} holds {len(x)} images but {paths[kind + '_y']} holds "
                f"{len(y)} labels: the two files must describe the same records"
            )

    def images(a):
        return (a.astype(np.float32) / 255.0)[..., None]

    if not test_files:
        return images(arrays["train_x"]), arrays["train_y"].astype(np.int32), None, None
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
        if not p.is_file():
            raise DatasetNotFoundError(
                f"{str(p)!r} is missing from the CIFAR-10 folder. " + _HOW_TO_POINT
            )
        try:
            with open(p, "rb") as f:
                d = pickle.load(f, encoding="bytes")
            data, labels = d[b"data"], d[b"labels"]
        except Exception as e:  # noqa: BLE001 - a corrupt pickle raises many kinds of errors
            raise ValueError(
                f"{p} is not a CIFAR-10 python batch (a dict with b'data' and b'labels'): "
                f"{type(e).__name__}: {e}"
            ) from None
        data = np.asarray(data)
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise ValueError(f"{p}: b'data' has shape {data.shape}, not (n, 3072)")
        if (
            not np.issubdtype(data.dtype, np.integer)
            or data.min(initial=0) < 0
            or data.max(initial=0) > 255
        ):
            raise ValueError(f"{p}: b'data' must hold bytes (integers 0..255)")
        y = np.asarray(labels)
        if y.ndim != 1 or len(y) != len(data):
            raise ValueError(f"{p}: {len(data)} images but labels of shape {y.shape}")
        x = data.astype(np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return x.astype(np.float32) / 255.0, y

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
