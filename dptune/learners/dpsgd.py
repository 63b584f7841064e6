"""This project's DP-SGD (``trainers``) as a dptune trainer: the one module of ``dptune`` that
imports ``trainers``.

It declares each candidate's privacy from its hyperparameters and the dataset's PUBLIC nominal
size (``trainers.spec.dpsgd_privacy``), trains candidates (``trainers.loop``), and says what of
the selected candidate may be released: its parameters, its per-epoch accuracy on the public test
split and its (noisy) validation score -- never its exact training losses.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dptune.accounting.events import DpSgdCandidate
from dptune.errors import CandidateFailure, TuningConfigError
from dptune.progress import epoch_bar
from dptune.trainer_protocol import DatasetTrainer, ReleaseView, source_digest
from trainers import loop, parallel
from trainers.data import NAMES as DATASETS
from trainers.data import Dataset, DatasetNotFoundError, load_dataset
from trainers.evaluate import evaluate
from trainers.spec import MODEL_NAMES, Hyperparams, dpsgd_privacy, steps_per_epoch

__all__ = [
    "DATASETS",
    "MODEL_NAMES",
    "DatasetNotFoundError",
    "DpSgdTrainer",
    "Hyperparams",
    "load_dataset",
]

log = logging.getLogger("dptune")

#: Hyperparameters that enter a DP-SGD candidate's DpEvent.
DPSGD_PRIVACY_FIELDS = ("noise_multiplier", "batch_size", "epochs", "score_noise_std")


def dpsgd_candidate(privacy: Any, score_noise_std: float | None) -> DpSgdCandidate:
    """``trainers.spec.DpSgdPrivacy`` (+ the score's noise) as an accounting candidate."""
    try:
        return DpSgdCandidate.from_dpsgd_privacy(privacy, score_noise_std=score_noise_std)
    except ValueError as e:
        raise TuningConfigError(str(e)) from None


def _failure(result: Any) -> CandidateFailure:
    """A failed ``trainers.spec.CandidateResult`` as the journal's failure record."""
    error = result.error or "NonFiniteParameters: the parameters became non-finite"
    kind, _, message = error.partition(": ")
    return CandidateFailure(kind, message, result.traceback or "")


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
        out: list[tuple[float, Any]] = []
        for i, r in enumerate(results):
            if r.failed:
                # The curator's console: which error, not which score (a failure is data-dependent).
                failure = _failure(r)
                log.warning("a candidate failed: %s", failure.summary())
                out.append((float("nan"), failure))
                continue
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

    def check_inputs(self, hparams: Mapping[str, Any]) -> None:
        """Refuses, before any private computation, a candidate the loop would refuse when it
        starts (e.g. a model whose input shape is not the images'): public schema only."""
        try:
            loop.check_inputs(self.hyperparams(hparams), self.data)
        except ValueError as e:
            raise TuningConfigError(str(e)) from None

    def code_digest(self) -> str:
        """This module and the ``trainers`` package's sources (the DP-SGD engine)."""
        package = Path(loop.__file__).parent
        return source_digest(files=[Path(__file__), *sorted(package.glob("*.py"))])

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
