"""This project's DP-SGD (``trainers``) as a dptune trainer: the one module of ``dptune`` that
imports ``trainers``.

It declares each candidate's privacy from its hyperparameters and the dataset's PUBLIC nominal
size (``trainers.spec.dpsgd_privacy``), trains candidates (``trainers.loop``), and says what of
the selected candidate may be released: its parameters, its per-epoch accuracy on the public test
split and its (noisy) validation score -- never its exact training losses.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dptune.accounting.events import DpSgdCandidate
from dptune.errors import TuningConfigError
from dptune.progress import epoch_bar
from dptune.trainer_protocol import DatasetTrainer, ReleaseView
from trainers import loop, parallel, probe, runtime
from trainers.data import NAMES as DATASETS
from trainers.data import Dataset, DatasetNotFoundError, load_dataset
from trainers.evaluate import evaluate
from trainers.spec import MODEL_NAMES, Hyperparams, dpsgd_privacy

__all__ = [
    "COMPILATION_CACHE_ENV",
    "DATASETS",
    "MODEL_NAMES",
    "DatasetNotFoundError",
    "DpSgdTrainer",
    "Hyperparams",
    "default_compilation_cache_dir",
    "load_dataset",
    "use_compilation_cache",
]

log = logging.getLogger("dptune")

#: Hyperparameters that enter a DP-SGD candidate's DpEvent.
DPSGD_PRIVACY_FIELDS = ("noise_multiplier", "batch_size", "epochs", "score_noise_std")


#: Environment variable: the folder of JAX's compilation cache, or "off" (default: on, in
#: :func:`default_compilation_cache_dir`).
COMPILATION_CACHE_ENV = "DPTUNE_COMPILATION_CACHE"
_OFF_WORDS = ("off", "false", "no", "none", "0")
_cache_decided = False


def default_compilation_cache_dir() -> Path:
    """The user's cache folder for dptune's compiled steps: ``$XDG_CACHE_HOME/dptune/jax``
    (``~/.cache/dptune/jax``; ``~/Library/Caches/dptune/jax`` on macOS,
    ``%LOCALAPPDATA%\\dptune\\jax`` on Windows)."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt" and os.environ.get("LOCALAPPDATA"):
        base = Path(os.environ["LOCALAPPDATA"])
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dptune" / "jax"


def use_compilation_cache(setting: str | os.PathLike | bool | None = None) -> str | None:
    """Turns JAX's persistent compilation cache on (warm starts: a second run, a resumed run and
    a Ray worker load the compiled steps instead of compiling them) or off; returns its folder or
    None (``trainers.runtime.enable_compilation_cache``).

    Args:
      setting: None (automatic: the first decision in this process stands; else a folder the
        user already gave JAX, e.g. ``JAX_COMPILATION_CACHE_DIR``; else
        ``$DPTUNE_COMPILATION_CACHE``; else :func:`default_compilation_cache_dir`), True (the
        default folder), False or "off" (no cache), or a folder ("" is the default folder).
    """
    global _cache_decided
    explicit = setting is not None
    if setting is None:
        current = jax.config.jax_compilation_cache_dir
        if _cache_decided or current is not None:
            if not _cache_decided:  # a folder the user gave JAX: the probe's results go there too
                probe.set_cache_file(Path(current) / "vectorize_probe.json")
            _cache_decided = True
            return current
        setting = os.environ.get(COMPILATION_CACHE_ENV) or True
    if isinstance(setting, str) and setting.strip().lower() in _OFF_WORDS:
        setting = False
    if setting is True or setting == "":
        folder: Any = default_compilation_cache_dir()
    else:
        folder = setting or None
    _cache_decided = True
    try:
        folder = runtime.enable_compilation_cache(folder)
        # The vectorised-or-sequential probe's results live beside the compiled steps.
        probe.set_cache_file(None if folder is None else Path(folder) / "vectorize_probe.json")
        return folder
    except OSError as e:
        if explicit:
            raise TuningConfigError(
                f"compilation cache folder {folder}: {e}; give a writable folder or 'off'"
            ) from None
        # A cache is a convenience: a read-only home must not stop a private run.
        log.warning("no compilation cache (%s): every run compiles from scratch", e)
        return None


def dpsgd_candidate(privacy: Any, score_noise_std: float | None) -> DpSgdCandidate:
    """``trainers.spec.DpSgdPrivacy`` (+ the score's noise) as an accounting candidate."""
    try:
        return DpSgdCandidate.from_dpsgd_privacy(privacy, score_noise_std=score_noise_std)
    except ValueError as e:
        raise TuningConfigError(str(e)) from None


class DpSgdTrainer(DatasetTrainer):
    """This project's DP-SGD trainer (``trainers.loop``) on an in-memory dataset.

    A candidate computes what the selection consumes (its noisy validation score) and the
    per-epoch privacy of its training (which travels in its payload to the release); the test
    split is evaluated once, for the released candidate (``release_view``).

    Args:
      data: a ``trainers.data.Dataset``.
      base: default hyperparameters (``trainers.spec.Hyperparams`` fields) that the space's values
        override.
      epoch_progress: whether to show a per-epoch tqdm bar (the curator's console only).
      test_curve: the curator's view, on request: evaluate EVERY candidate on the public test split
        after each epoch (one test-set pass per candidate and epoch) and keep the curves in their
        payloads (``DIR/private/``); the released candidate's curve then shows its test accuracy
        per epoch. Off by default: selection never reads the test split.
      compilation_cache: JAX's persistent compilation cache (:func:`use_compilation_cache`): None
        (automatic: on, in the user's cache folder, unless already decided or
        ``$DPTUNE_COMPILATION_CACHE=off``), False (off) or a folder.
    """

    hyperparams_class = Hyperparams
    kind = "DP-SGD"

    privacy_fields = DPSGD_PRIVACY_FIELDS
    calibrated_field = "noise_multiplier"

    def __init__(
        self,
        data: Dataset,
        base: Mapping[str, Any] | None = None,
        epoch_progress: bool = True,
        test_curve: bool = False,
        compilation_cache: str | os.PathLike | bool | None = None,
    ) -> None:
        self.data = data
        self.test_curve = test_curve
        self.base = dict(base or {})
        # The PUBLIC nominal training size (declared or published), never len() of private arrays.
        self.num_examples = int(data.public_num_train)
        self.epoch_progress = epoch_progress
        self.compilation_cache = compilation_cache

    def _privacy(self, hp: Hyperparams, steps: int | None = None) -> DpSgdCandidate:
        if hp.score_noise_std is None and not self.data.validation_public:
            raise TuningConfigError(
                "score_noise_std=None (an exact validation score) needs a validation set declared "
                "public and separate from the private data, but this dataset's validation split "
                "is private: set score_noise_std > 0 (config.train.score_noise_std), or load a "
                "separate public validation set (config.data.validation_dir with "
                "config.data.validation_public=True)"
            )
        try:
            privacy = dpsgd_privacy(hp, self.num_examples)
        except ValueError as e:
            raise TuningConfigError(f"invalid DP-SGD setting: {e}") from None
        if steps is not None:
            privacy = type(privacy)(privacy.sampling_rate, int(steps), privacy.noise_multiplier)
        return dpsgd_candidate(privacy, hp.score_noise_std)

    def privacy(self, hparams: Mapping[str, Any]) -> DpSgdCandidate:
        """The candidate's privacy: ``steps`` Poisson-subsampled Gaussian steps at q = B / N_public
        and, in parallel, the noisy validation count."""
        return self._privacy(self.hyperparams(hparams))

    def __call__(self, hparams: Mapping[str, Any], rng: np.random.Generator) -> tuple[float, Any]:
        return self.train_many([hparams], [rng])[0]

    def train_many(
        self, hparams: Sequence[Mapping[str, Any]], rngs: Sequence[np.random.Generator]
    ) -> list[tuple[float, Any]]:
        """Trains len(hparams) candidates at once (``trainers.loop.train_candidates``); a failed
        candidate scores NaN.

        Each payload holds the parameters, the per-epoch rows of ``CandidateResult.history``
        (private: exact training losses), ``privacy_by_epoch``, the accounting candidate of the
        training up to each of those epochs (a public function of the hyperparameters and the
        step count), so the release reads the curve's privacy from the result, and
        ``execution``: whether structurally identical candidates were trained vectorised, as a
        short measurement on this device chose (``trainers.probe``; journaled with the payload,
        never printed: whether a call had two candidates to vectorise depends on K)."""
        use_compilation_cache(self.compilation_cache)
        hps = [self.hyperparams(h) for h in hparams]
        choice = probe.choose_for(hps, self.data.num_classes, self.data.train_x.shape[1:])
        execution: dict[str, Any] = {"vectorized": bool(choice and choice.vectorize)}
        if choice is not None:
            execution.update(probe=dataclasses.asdict(choice), reason=choice.describe())
        # The full 64 bits of a threefry key, drawn from the candidate's (OS-entropy) generator:
        # the DP noise must not be guessable from a small seed space.
        keys = [r.integers(0, 2**32, size=2, dtype=np.uint32) for r in rngs]
        # Per-epoch accuracy on the public test split, only on request (the curator's view).
        test_curve: dict[int, dict[int, float]] = {}

        def on_epoch(i: int, epoch: int, params: Any) -> None:
            test_curve.setdefault(i, {})[epoch] = float(
                evaluate(params, hps[i].model, self.data.test_x, self.data.test_y)
            )

        with_curve = self.test_curve and len(self.data.test_y) > 0
        with epoch_bar(self.epoch_progress, sum(hp.epochs for hp in hps)) as progress:
            results = loop.train_candidates(
                hps, self.data, keys, progress=progress, on_epoch=on_epoch if with_curve else None,
                vectorize=execution["vectorized"],
            )  # fmt: skip
        out = []
        for i, r in enumerate(results):
            if r.failed:
                # The curator's console: which error, not which score (a failure is data-dependent).
                log.warning("a candidate failed: %s", (r.error or "non-finite parameters")[:200])
            curve = test_curve.get(i, {})
            history = [
                {**h, **({"test_accuracy": curve[h["epoch"]]} if h.get("epoch") in curve else {})}
                for h in r.history
            ]
            payload = {
                "params": jax.tree_util.tree_map(np.asarray, r.params),
                "history": history,
                "privacy_by_epoch": [
                    self._privacy(hps[i], h["steps"]) for h in history if "steps" in h
                ],
                "execution": execution,
            }
            out.append((float(r.validation_score), payload))
        return out

    def data_parallel(self, devices: Sequence[Any]) -> Any:
        """Context manager under which each candidate trains data-parallel over ``devices``
        (``trainers.parallel``: per-example clipping on each device's shard, the clipped sums
        reduced, the noise added once): the hook of the ``"devices"`` executor."""
        return parallel.data_parallel(parallel.data_mesh(list(devices)))

    def release_view(self, hparams: Mapping[str, Any], payload: Any) -> ReleaseView:
        """The parameters, the public per-epoch rows (``test_*`` on the public test split when the
        curator asked for test curves, ``noisy_*`` privatised), their privacy so far, and the
        test accuracy (one pass over the test split, for the released candidate only); the
        exact training losses stay in ``DIR/private/``: they are a non-private function of the
        data."""
        if not isinstance(payload, Mapping) or payload.get("params") is None:
            return ReleaseView(None)
        use_compilation_cache(self.compilation_cache)
        public = ("test_", "noisy_")
        history = [
            {"epoch": h["epoch"], **{k: v for k, v in h.items() if k.startswith(public)}}
            for h in payload.get("history", [])
            if "epoch" in h
        ]
        privacy = list(payload.get("privacy_by_epoch", ()))
        test_acc = history[-1].get("test_accuracy") if history else None
        if test_acc is None and len(self.data.test_y):
            hp = self.hyperparams(hparams)
            test_acc = float(
                evaluate(payload["params"], hp.model, self.data.test_x, self.data.test_y)
            )
        return ReleaseView(
            {"params": payload["params"]}, test_acc, history,
            privacy_by_epoch=privacy if len(privacy) == len(history) else (),
        )  # fmt: skip

    def privacy_notes(self) -> list[str]:
        """Sentences for the privacy statement: how the validation split was formed, and which
        public size the sampling rate comes from."""
        return [
            self.data.describe_split() + ".",
            f"Sampling rates and step counts use the public nominal training size "
            f"{self.num_examples}, not the private data's length.",
        ]

    def check_adjacency(self, adjacency: str) -> None:
        """Replace-one needs a fixed, public dataset size: the loaded file must hold exactly the
        declared number of records."""
        if adjacency != "replace_one":
            return
        declared = self.data.split.get("num_examples")
        actual = len(self.data.train_y) + len(self.data.val_y)
        if declared is None or declared != actual:
            raise TuningConfigError(
                "adjacency='replace_one' assumes a dataset of fixed, public size, but the loaded "
                f"training file holds {actual} records and {declared} were declared "
                "(config.data.num_examples); declare the exact size or use 'add_remove'"
            )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "dpsgd",
            "dataset": self.data.name,
            "num_examples": self.num_examples,
            "base": self.base,
        }
