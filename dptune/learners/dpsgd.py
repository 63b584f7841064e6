"""This project's DP-SGD (``trainers``) as a dptune trainer: the one module of ``dptune`` that
imports ``trainers``.

It declares each candidate's privacy from its hyperparameters and the dataset's PUBLIC nominal
size (``trainers.spec.dpsgd_privacy``), trains candidates (``trainers.loop``), and says what of
the selected candidate may be released: its parameters, its per-epoch accuracy on the public test
split and its (noisy) validation score -- never its exact training losses.

A candidate's privacy depends on (batch size, epochs, noise multiplier, score noise) and the public
size alone, never on the model: a user's Flax module goes through the same declaration, checks,
ledger and release as a shipped model. This module also re-exports the pieces for users who keep
their own training loop (``docs/your_model.md``): ``Dataset``, ``Metric``, ``DpSgdSchedule``,
``clipped_grad_sum``, ``add_noise`` and :func:`dpsgd_privacy`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dptune.accounting.events import DpSgdCandidate
from dptune.errors import TuningConfigError
from dptune.progress import epoch_bar
from dptune.trainer_protocol import DatasetTrainer, ReleaseView
from trainers import loop, models, parallel
from trainers import step as step_lib
from trainers.data import ARRAY_SOURCES, Dataset, DatasetNotFoundError, load_dataset, read_npz
from trainers.data import NAMES as DATASETS
from trainers.data import check_arrays as check_user_arrays
from trainers.evaluate import BoundedMetric, evaluate
from trainers.spec import MODEL_NAMES, DpSgdSchedule, Hyperparams, steps_per_epoch
from trainers.spec import dpsgd_privacy as _hp_privacy
from trainers.userloop import add_noise, clipped_grad_sum

#: A per-record validation metric bounded in [lo, hi] (``trainers.evaluate.BoundedMetric``).
Metric = BoundedMetric

__all__ = [
    "ARRAY_SOURCES",
    "DATASETS",
    "MODEL_NAMES",
    "Dataset",
    "DatasetNotFoundError",
    "DpSgdSchedule",
    "DpSgdTrainer",
    "Hyperparams",
    "Metric",
    "add_noise",
    "check_user_arrays",
    "clipped_grad_sum",
    "dpsgd_privacy",
    "load_dataset",
    "read_npz",
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


def dpsgd_privacy(
    schedule: DpSgdSchedule, noise_multiplier: float, *, score_noise_std: float | None = None
) -> DpSgdCandidate:
    """The privacy declaration of one DP-SGD run of your own loop, for ``dptune.trainer(privacy=
    ...)``: ``schedule.steps`` Poisson-subsampled Gaussian mechanisms at rate ``schedule.
    sampling_rate`` (both from the PUBLIC size, exactly what ``schedule.batches`` draws) with noise
    multiplier sigma and, in parallel, a noisy validation count of std ``score_noise_std`` (None: no
    private score). The same object the built-in trainer declares (``DpSgdCandidate``)."""
    return dpsgd_candidate(schedule.privacy(noise_multiplier), score_noise_std)


class DpSgdTrainer(DatasetTrainer):
    """This project's DP-SGD trainer (``trainers.loop``) on an in-memory dataset.

    Args:
      data: a ``trainers.data.Dataset`` (e.g. ``dptune.Dataset.from_arrays(x, y,
        num_examples=...)``).
      base: default hyperparameters (``trainers.spec.Hyperparams`` fields) that the space's values
        override.
      epoch_progress: whether to show a per-epoch tqdm bar (the curator's console only).
      test_curve: evaluate every candidate on the public test split after each epoch, so that the
        released candidate's training curve shows its test accuracy (costs one test-set pass per
        epoch).
      model: a shipped model name (``trainers.spec.MODEL_NAMES``), a ``flax.linen.Module``
        instance, or an ``(init_fn, apply_fn)`` pair (``init_fn(key, x) -> params``,
        ``apply_fn(params, x) -> outputs``); the input shape and dtype come from ``data``. Default:
        ``base["model"]`` or "cnn26k". A module is checked before anything trains (state other than
        parameters such as BatchNorm statistics, examples mixed in a batch, a per-example loss).
      loss: ``loss(outputs, labels) -> (b,)`` per-example losses; default softmax cross-entropy on
        integer labels.
      metric: a ``dptune.Metric(fn, lo, hi)`` (per record, bounded, clipped to [lo, hi]) scoring
        candidates on the validation split; default accuracy.
      grad_impl: per-example clipping: "auto" (a shipped model's hand-tuned path, else the ghost
        path when every parametrised layer is known, else vmap(grad), said once in the log),
        "ghost" or "vmap" to force one ("bookkeeping" / "naive": the old spellings).
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
        *,
        model: Any = None,
        loss: Any = None,
        metric: Any = None,
        grad_impl: str = "auto",
    ) -> None:
        self.data = data
        self.test_curve = test_curve
        self.base = dict(base or {})
        # The PUBLIC nominal training size (declared or published), never len() of private arrays.
        self.num_examples = int(data.public_num_train)
        self.epoch_progress = epoch_progress
        if grad_impl not in step_lib.GRAD_IMPLS:
            raise TuningConfigError(
                f"grad_impl={grad_impl!r} must be one of {step_lib.GRAD_IMPLS[:3]}"
            )
        self.grad_impl = grad_impl
        if model is not None or loss is not None or metric is not None:
            self.base["model"] = self._model_spec(model, loss, metric)
        self.model = self.base.get("model", "cnn26k")
        if grad_impl in ("ghost", "bookkeeping"):
            try:  # a forced path that does not apply is refused before anything private runs
                step_lib.resolve_grad_impl(
                    models.resolve(self.model, data.num_classes), grad_impl, data.image_shape
                )
            except ValueError as e:
                raise TuningConfigError(str(e)) from None

    def _model_spec(self, model: Any, loss: Any, metric: Any) -> Any:
        """``model`` (+ loss, metric) as what ``Hyperparams.model`` holds: a shipped name as it
        is, anything else a checked ``trainers.models.ModelSpec``."""
        if model is None:
            model = self.base.get("model", "cnn26k")
        elif "model" in self.base:
            raise TuningConfigError(
                "the model is given twice (model=... and base['model']): keep one"
            )
        if metric is not None and not isinstance(metric, BoundedMetric):
            raise TuningConfigError(
                f"metric={metric!r:.60}: a validation metric must declare its range, e.g. "
                "dptune.Metric(fn, lo=0.0, hi=1.0) (fn(outputs, labels) -> one value per record), "
                "so that its noisy sum has a known sensitivity"
            )
        if isinstance(model, str) and loss is None and metric is None:
            return model
        if isinstance(model, str):  # a shipped architecture with the user's loss or metric
            try:
                model = models.get_model(model, self.data.num_classes).module
            except ValueError as e:
                raise TuningConfigError(str(e)) from None
        x = self.data.train_x
        try:
            return models.user_model(
                model, x.shape[1:], x.dtype, loss=loss, metric=metric,
                num_classes=self.data.num_classes,
            )  # fmt: skip
        except (TypeError, ValueError) as e:
            raise TuningConfigError(str(e)) from None

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
            privacy = _hp_privacy(hp, self.num_examples)
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
                hps, self.data, keys, progress=progress, on_epoch=on_epoch,
                grad_impl=self.grad_impl,
            )  # fmt: skip
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
        """What the journal binds a workdir to (JSON-safe, stable across processes)."""
        base = dict(self.base)
        if "model" in base and not isinstance(base["model"], str):
            base["model"] = describe_model(base["model"])
        out = {
            "kind": "dpsgd",
            "dataset": self.data.name,
            "num_examples": self.num_examples,
            "base": base,
        }
        if self.grad_impl != "auto":
            out["grad_impl"] = self.grad_impl
        return out


def describe_model(spec: Any) -> dict[str, Any]:
    """A user's model as JSON: its class, parameter shapes, loss and metric (no addresses, so the
    same model describes the same way in every process)."""

    def qualname(f: Any) -> str | None:
        if f is None:
            return None
        return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', type(f).__name__)}"

    shapes = jax.eval_shape(lambda: models.init_params(spec, jax.random.PRNGKey(0)))
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    out: dict[str, Any] = {
        "name": spec.name,
        "class": qualname(type(spec.module))
        if spec.module is not None
        else qualname(spec.apply_fn),
        "input": [list(spec.input_shape), spec.input_dtype],
        "params": {jax.tree_util.keystr(k): list(v.shape) for k, v in flat},
    }
    if spec.loss is not None:
        out["loss"] = qualname(spec.loss)
    if spec.metric is not None:
        m = spec.metric
        out["metric"] = {"fn": qualname(m.fn), "lo": float(m.lo), "hi": float(m.hi)}
    return out
