"""Wavelet scattering features (Kymatio) for 28x28 grey images, cached on disk per record.

Tramer & Boneh 2021 (ICLR, "Differentially Private Learning Needs Better Features", §3) train
linear models and small CNNs under DP-SGD on the scattering transform of Oyallon & Mallat (2015)
with J = 2 scales and L = 8 angles: a fixed, non-learned map from a (28, 28) image to (81, 7, 7)
coefficients. The transform is data-independent (a fixed function applied to each record on its
own), so computing it costs no privacy: only DP-SGD on the features does.

Features are stored NHWC, (n, 7, 7, 81) float32, so that flax convolutions consume them directly.

Cache: computing the transform for Fashion-MNIST's 70,000 images takes minutes on 2 CPU cores, so
every record's features are stored on disk once, keyed by a hash of the record itself (blake2b-128
of its float32 bytes) and of the transform settings. Keying by record, not by split, means a new
train/validation split of the same records (or a new test split) reuses the cache. The cache holds
a deterministic function of the private images, so it is as sensitive as the data: it lives in the
curator's cache folder (``$DPTUNE_CACHE`` or ``~/.cache/dptune``) and must be deleted with the data.

Backend: Kymatio's 2-D JAX frontend (``ScatteringJax2D``), its whole transform compiled with
``jax.jit`` for two fixed batch sizes, :data:`BATCH` and :data:`SMALL_BATCH` images (a short batch
zero-padded, padding rows dropped), so it runs on the accelerator when JAX has one and on all CPU
cores otherwise; 1.4-1.9x faster than the NumPy frontend on the 2-core CPU (4,096 images, back to
back), and the two agree to float32 rounding (tested). ``DPTUNE_SCATTER_BACKEND=numpy`` selects
the NumPy frontend. The backend and JAX platform are part of the cache folder's name: features
computed on a GPU (float32 FFTs in another order) are not mixed with CPU ones.

Kymatio is an optional dependency (``pip install 'dptune[scatter]'``). Kymatio 0.3.0's top-level
``kymatio.numpy`` / ``kymatio.jax`` also import its 3-D frontend, which fails with SciPy >= 1.15
(``sph_harm`` was removed), so the 2-D frontends are imported directly.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import threading
import uuid
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

#: Scattering settings of Tramer & Boneh 2021 for 28x28 images: J = 2 scales, L = 8 angles.
J, L = 2, 8
IMAGE_HW = (28, 28)
#: Channels of the J = 2, L = 8 transform: 1 + J L + L^2 J (J - 1) / 2 = 1 + 16 + 64 = 81.
CHANNELS = 1 + J * L + L * L * J * (J - 1) // 2
#: Spatial size after the transform: 28 / 2^J.
OUT_HW = (IMAGE_HW[0] // 2**J, IMAGE_HW[1] // 2**J)
#: Shape of one record's features (NHWC without the batch axis).
FEATURE_SHAPE = (*OUT_HW, CHANNELS)

#: Images per compiled scattering call (one compilation; ~0.7 GB of complex64 intermediates).
BATCH = 1024
#: The other compiled batch size, for short inputs.
SMALL_BATCH = 64


class KymatioMissingError(ImportError):
    """Kymatio is not installed; the message says how to install it."""


def backend_name() -> str:
    """``"jax"`` (default) or ``"numpy"`` (``$DPTUNE_SCATTER_BACKEND``)."""
    name = os.environ.get("DPTUNE_SCATTER_BACKEND", "jax").strip().lower()
    if name not in ("jax", "numpy"):
        raise ValueError(f"DPTUNE_SCATTER_BACKEND must be 'jax' or 'numpy', not {name!r}")
    return name


def _missing() -> KymatioMissingError:
    return KymatioMissingError(
        "the scattering models ('scatter_linear', 'scatter_cnn') need Kymatio: "
        "pip install 'dptune[scatter]' (or pip install kymatio)"
    )


def _scattering(backend: str = "numpy"):
    """Kymatio's 2-D scattering with (J, L) = (2, 8) on 28x28 inputs (built once per backend):
    for ``"numpy"`` the frontend object, for ``"jax"`` a jitted function (BATCH, 28, 28) float32
    -> (BATCH, 81, 7, 7) float32."""
    if backend not in _SCAT:
        try:
            # optional: Kymatio is the [scatter] extra. Not `kymatio.numpy` / `kymatio.jax`: they
            # import the 3-D frontend (broken with SciPy >= 1.15).
            if backend == "jax":
                from kymatio.scattering2d.frontend.jax_frontend import ScatteringJax2D
            else:
                from kymatio.scattering2d.frontend.numpy_frontend import ScatteringNumPy2D
        except ImportError as e:
            raise _missing() from e
        if backend == "jax":
            import jax  # only for the jax backend (the numpy one must not initialise JAX)

            # The whole transform (a static Python loop over filters of jnp ops) traces into one
            # program; every batch has the same shape, so it compiles once.
            _SCAT[backend] = jax.jit(ScatteringJax2D(J=J, shape=IMAGE_HW, L=L).scattering)
        else:
            _SCAT[backend] = ScatteringNumPy2D(J=J, shape=IMAGE_HW, L=L)
    return _SCAT[backend]


_SCAT: dict = {}


def kymatio_version() -> str:
    """Installed Kymatio version (part of the cache key: a new version may change the filters)."""
    try:
        return importlib.metadata.version("kymatio")
    except importlib.metadata.PackageNotFoundError as e:
        raise KymatioMissingError(
            "Kymatio is not installed: pip install 'dptune[scatter]' (or pip install kymatio)"
        ) from e


def compute(images: np.ndarray, backend: str | None = None) -> np.ndarray:
    """Scattering features of ``images`` without any cache.

    Each record's features are a function of that record alone (the transform is per image; a
    batch only shares the FFT call): tested by changing a record's batch companions.

    Args:
      images: float32 (n, 28, 28, 1) (or (n, 28, 28)), values in [0, 1].
      backend: "jax" or "numpy" (default :func:`backend_name`).
    Returns:
      float32 (n, 7, 7, 81), NHWC.
    """
    x = _as_images(images)
    backend = backend or backend_name()
    scat = _scattering(backend)
    out = np.empty((len(x), *FEATURE_SHAPE), np.float32)
    for start in range(0, len(x), BATCH):
        chunk = x[start : start + BATCH]
        if backend == "jax":
            b = len(chunk)
            # Zero rows pad a short batch to one of two compiled shapes (SMALL_BATCH for the few
            # records of an evaluation or a cache top-up, else BATCH); their outputs are dropped.
            padded = np.zeros((SMALL_BATCH if b <= SMALL_BATCH else BATCH, *IMAGE_HW), np.float32)
            padded[:b] = chunk
            s = np.asarray(scat(padded))[:b]  # (b, 81, 7, 7)
        else:
            s = scat(chunk)  # (b, 81, 7, 7)
        out[start : start + len(s)] = np.transpose(s, (0, 2, 3, 1))
    return out


def record_digests(images: np.ndarray) -> np.ndarray:
    """blake2b-128 of every record's float32 bytes: (n,) array of 16-byte strings ('S16')."""
    x = np.ascontiguousarray(_as_images(images))
    flat = x.reshape(len(x), -1)
    return np.array([hashlib.blake2b(r.tobytes(), digest_size=16).digest() for r in flat], "S16")


def _platform(backend: str) -> str:
    """``numpy`` or ``jax-<platform>`` (``jax-cpu``, ``jax-gpu``): part of the cache folder name."""
    if backend == "numpy":
        return "numpy"
    import jax  # only for the jax backend (the numpy one must not initialise JAX)

    return f"jax-{jax.default_backend()}"


def default_cache_dir() -> Path:
    """``$DPTUNE_CACHE/scattering`` or ``~/.cache/dptune/scattering``."""
    root = os.environ.get("DPTUNE_CACHE") or Path.home() / ".cache" / "dptune"
    return Path(root) / "scattering"


class FeatureCache:
    """Per-record, content-addressed store of scattering features in one folder.

    The folder ``<root>/J2-L8-28x28-kymatio<version>/`` holds shards: ``<id>.keys.npy`` ((m,) S16
    record digests) and ``<id>.feat.npy`` ((m, 7, 7, 81) float32), written atomically (temporary
    name, then rename), so concurrent processes at worst compute a record twice. Features are read
    memory-mapped.
    """

    def __init__(self, root: str | os.PathLike | None = None, backend: str | None = None):
        base = Path(root) if root is not None else default_cache_dir()
        self.backend = backend or backend_name()
        self.folder = base / (
            f"J{J}-L{L}-{IMAGE_HW[0]}x{IMAGE_HW[1]}-kymatio{kymatio_version()}-{_platform(self.backend)}"
        )
        self._index: dict[bytes, tuple[int, int]] = {}
        self._shards: list[np.ndarray] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        #: records computed (not found in the cache) by this object: tests check cache hits with it.
        self.computed = 0

    def _refresh(self) -> None:
        if not self.folder.is_dir():
            return
        for keys_path in sorted(self.folder.glob("*.keys.npy")):
            sid = keys_path.name[: -len(".keys.npy")]
            feat_path = self.folder / f"{sid}.feat.npy"
            if sid in self._seen or not feat_path.is_file():
                continue
            keys = np.load(keys_path)
            feats = np.load(feat_path, mmap_mode="r")
            if feats.shape != (len(keys), *FEATURE_SHAPE):
                log.warning("ignoring a malformed scattering cache shard %s", feat_path)
                continue
            self._seen.add(sid)
            shard = len(self._shards)
            self._shards.append(feats)
            for row, k in enumerate(keys):
                self._index.setdefault(bytes(k), (shard, row))

    def features(self, images: np.ndarray) -> np.ndarray:
        """Scattering features of ``images`` ((n, 28, 28[, 1]) in [0, 1]) -> (n, 7, 7, 81)
        float32, computing and storing only the records not in the cache."""
        with self._lock:
            self._refresh()
            digests = record_digests(images)
            missing = [i for i, d in enumerate(digests) if bytes(d) not in self._index]
            if missing:
                # Unique missing records only (duplicate images share one entry).
                first: dict[bytes, int] = {}
                for i in missing:
                    first.setdefault(bytes(digests[i]), i)
                idx = np.fromiter(first.values(), np.int64)
                log.info("computing scattering features of %d records (cached after)", len(idx))
                feats = compute(np.asarray(images)[idx], self.backend)
                self.computed += len(idx)
                self._write_shard(digests[idx], feats)
                self._refresh()
            out = np.empty((len(digests), *FEATURE_SHAPE), np.float32)
            for i, d in enumerate(digests):
                shard, row = self._index[bytes(d)]
                out[i] = self._shards[shard][row]
            return out

    def _write_shard(self, keys: np.ndarray, feats: np.ndarray) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        sid = uuid.uuid4().hex
        tmp = f".tmp-{sid}"
        # Features first, keys last: a shard counts only once its keys file exists.
        np.save(self.folder / f"{tmp}.feat.npy", feats)
        os.replace(self.folder / f"{tmp}.feat.npy", self.folder / f"{sid}.feat.npy")
        np.save(self.folder / f"{tmp}.keys.npy", keys)
        os.replace(self.folder / f"{tmp}.keys.npy", self.folder / f"{sid}.keys.npy")


_CACHES: dict[str, FeatureCache] = {}


def get_cache(root: str | os.PathLike | None = None) -> FeatureCache:
    """The process-wide :class:`FeatureCache` for ``root`` (default :func:`default_cache_dir`)."""
    key = f"{Path(root) if root is not None else default_cache_dir()}|{backend_name()}"
    if key not in _CACHES:
        _CACHES[key] = FeatureCache(root)
    return _CACHES[key]


def features(images: np.ndarray, cache_dir: str | os.PathLike | None = None) -> np.ndarray:
    """Cached scattering features of ``images`` ((n, 28, 28, 1) float32 in [0, 1]) ->
    (n, 7, 7, 81) float32 (NHWC)."""
    return get_cache(cache_dir).features(images)


def _as_images(images: np.ndarray) -> np.ndarray:
    x = np.asarray(images, np.float32)
    if x.ndim == 4 and x.shape[-1] == 1:
        x = x[..., 0]
    if x.ndim != 3 or x.shape[1:] != IMAGE_HW:
        raise ValueError(
            f"scattering features need grey 28x28 images, (n, 28, 28, 1); got {np.shape(images)}"
        )
    return x
