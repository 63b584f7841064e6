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
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dptune.accounting.events import DpSgdCandidate
from dptune.errors import TuningConfigError
from dptune.progress import epoch_bar
from dptune.trainer_protocol import DatasetTrainer, ReleaseView
from trainers import loop, parallel
from trainers.data import Dataset, DatasetNotFoundError, load_dataset, subset_dataset
from trainers.evaluate import evaluate
from trainers.spec import Hyperparams, dpsgd_privacy, steps_per_epoch

__all__ = ["DatasetNotFoundError", "DpSgdTrainer", "Hyperparams", "load_dataset"]

log = logging.getLogger("dptune")

#: Hyperparameters that enter a DP-SGD candidate's DpEvent.
DPSGD_PRIVACY_FIELDS = ("noise_multiplier", "batch_size", "epochs", "score_noise_std")


def dpsgd_candidate(privacy: Any, score_noise_std: float | None) -> DpSgdCandidate:
    """``trainers.spec.DpSgdPrivacy`` (+ the score's noise) as an accounting candidate."""
    try:
        return DpSgdCandidate.from_dpsgd_privacy(privacy, score_noise_std=score_noise_std)
    except ValueError as e:
        raise TuningConfigError(str(e)) from None


class DpSgdTrainer(DatasetTrainer):
    """This project's DP-SGD trainer (``trainers.loop``) on an in-memory dataset.

    Args:
      data: a ``trainers.data.Dataset``.
      base: default hyperparameters (``trainers.spec.Hyperparams`` fields) that the space's values
        override.
      epoch_progress: whether to show a per-epoch tqdm bar (the curator's console only).
      test_curve: evaluate every candidate on the public test split after each epoch, so that the
        released candidate's training curve shows its test accuracy (costs one test-set pass per
        epoch).
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
        test_curve: bool = True,
    ) -> None:
        self.data = data
        self.test_curve = test_curve
        self.base = dict(base or {})
        # The PUBLIC nominal training size (declared or published), never len() of private arrays.
        self.num_examples = int(data.public_num_train)
        self.epoch_progress = epoch_progress

    #: Every candidate's expected batch size is multiplied by this (rounded, at least 1): 1 on the
    #: full data; ``fraction`` on a subset (``subset``), so a candidate on the subset keeps the
    #: full run's sampling rate and number of steps.
    batch_scale: float = 1.0

    def hyperparams(self, hparams: Mapping[str, Any]) -> Hyperparams:
        hp = super().hyperparams(hparams)
        if self.batch_scale != 1.0:
            hp = dataclasses.replace(hp, batch_size=max(1, round(hp.batch_size * self.batch_scale)))
        return hp

    def subset(self, fraction: float, key: bytes) -> DpSgdTrainer:
        """This trainer on a per-record Poisson subset of the private records (rate ``fraction``,
        secret ``key``: ``trainers.data.subset_dataset``), for subsampled tuning
        (``dptune.subsampled``). Public sizes are scaled by ``fraction``, and so is every
        candidate's expected batch: a candidate on the subset runs the same schedule (sampling
        rate B / N, epochs, steps) on fewer records. No per-epoch test curve (its candidates are
        never released)."""
        out = DpSgdTrainer(
            subset_dataset(self.data, fraction, key), self.base, self.epoch_progress, False
        )
        out.batch_scale = self.batch_scale * float(fraction)
        return out

    def _privacy(self, hp: Hyperparams, epochs: int | None = None) -> DpSgdCandidate:
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
        if epochs is not None:
            steps = epochs * steps_per_epoch(hp.batch_size, self.num_examples)
            privacy = type(privacy)(privacy.sampling_rate, steps, privacy.noise_multiplier)
        return dpsgd_candidate(privacy, hp.score_noise_std)

    def privacy(self, hparams: Mapping[str, Any]) -> DpSgdCandidate:
        """The candidate's privacy: ``steps`` Poisson-subsampled Gaussian steps at q = B / N_public
        and, in parallel, the noisy validation count."""
        return self._privacy(self.hyperparams(hparams))

    def privacy_by_epoch(self, hparams: Mapping[str, Any]) -> list[DpSgdCandidate]:
        """The privacy of the candidate's training up to each epoch (the last is ``privacy``)."""
        hp = self.hyperparams(hparams)
        return [self._privacy(hp, e) for e in range(1, hp.epochs + 1)]

    def __call__(self, hparams: Mapping[str, Any], rng: np.random.Generator) -> tuple[float, Any]:
        return self.train_many([hparams], [rng])[0]

    def train_many(
        self, hparams: Sequence[Mapping[str, Any]], rngs: Sequence[np.random.Generator]
    ) -> list[tuple[float, Any]]:
        """Trains len(hparams) candidates at once (``trainers.loop.train_candidates``); a failed
        candidate scores NaN."""
        hps = [self.hyperparams(h) for h in hparams]
        # The full 64 bits of a threefry key, drawn from the candidate's (OS-entropy) generator:
        # the DP noise must not be guessable from a small seed space.
        keys = [r.integers(0, 2**32, size=2, dtype=np.uint32) for r in rngs]
        # Per-epoch accuracy on the public test split: part of the released candidate's training
        # curve; the other candidates' curves stay in private/ like the rest.
        test_curve: dict[int, dict[int, float]] = {}

        def on_epoch(i: int, epoch: int, params: Any) -> None:
            if self.test_curve and len(self.data.test_y):
                test_curve.setdefault(i, {})[epoch] = float(
                    evaluate(params, hps[i].model, self.data.test_x, self.data.test_y)
                )

        with epoch_bar(self.epoch_progress, sum(hp.epochs for hp in hps)) as progress:
            results = loop.train_candidates(
                hps, self.data, keys, progress=progress, on_epoch=on_epoch
            )
        out = []
        for i, r in enumerate(results):
            if r.failed:
                # The curator's console: which error, not which score (a failure is data-dependent).
                log.warning("a candidate failed: %s", (r.error or "non-finite parameters")[:200])
            curve = test_curve.get(i, {})
            payload = {
                "params": jax.tree_util.tree_map(np.asarray, r.params),
                "history": [
                    {
                        **h,
                        **({"test_accuracy": curve[h["epoch"]]} if h.get("epoch") in curve else {}),
                    }
                    for h in r.history
                ],
            }
            out.append((float(r.validation_score), payload))
        return out

    def data_parallel(self, devices: Sequence[Any]) -> Any:
        """Context manager under which each candidate trains data-parallel over ``devices``
        (``trainers.parallel``: per-example clipping on each device's shard, the clipped sums
        reduced, the noise added once): the hook of the ``"devices"`` executor."""
        return parallel.data_parallel(parallel.data_mesh(list(devices)))

    def release_view(self, hparams: Mapping[str, Any], payload: Any) -> ReleaseView:
        """The parameters, the public per-epoch rows (``test_*`` on the public test split,
        ``noisy_*`` privatised) and the final test accuracy; the exact training losses stay in
        ``DIR/private/``: they are a non-private function of the data."""
        if not isinstance(payload, Mapping) or payload.get("params") is None:
            return ReleaseView(None)
        history = [
            {
                "epoch": h["epoch"],
                **{k: v for k, v in h.items() if k.startswith(("test_", "noisy_"))},
            }
            for h in payload.get("history", [])
            if "epoch" in h
        ]
        test_acc = history[-1].get("test_accuracy") if history else None
        if test_acc is None and len(self.data.test_y):
            hp = self.hyperparams(hparams)
            test_acc = float(
                evaluate(payload["params"], hp.model, self.data.test_x, self.data.test_y)
            )
        return ReleaseView({"params": payload["params"]}, test_acc, history)

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
