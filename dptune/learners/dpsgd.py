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
``clipped_grad_sum``, ``add_noise`` and :func:`dpsgd_privacy`; and ``with_lora`` (LoRA adapters
on a linen module, ``docs/finetune.md``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from dptune.accounting.calibration import COMPILATION_CACHE_ENV, OFF_WORDS, cache_root
from dptune.accounting.events import DpSgdCandidate
from dptune.errors import CandidateFailure, TuningConfigError
from dptune.progress import epoch_bar
from dptune.trainer_protocol import DatasetTrainer, ReleaseView, config_section, source_digest
from trainers import finetune, loop, lora, models, parallel, probe, runtime
from trainers import step as step_lib
from trainers.data import (
    ARRAY_SOURCES,
    Dataset,
    DatasetNotFoundError,
    load_dataset,
    read_npz,
    subset_dataset,
)
from trainers.data import NAMES as DATASETS
from trainers.data import check_arrays as check_user_arrays
from trainers.evaluate import BoundedMetric, evaluate, evaluate_metric
from trainers.fix_model import fix_model
from trainers.nnx_model import NnxModel
from trainers.spec import MODEL_NAMES, DpSgdSchedule, Hyperparams
from trainers.spec import dpsgd_privacy as _hp_privacy
from trainers.userloop import add_noise, clipped_grad_sum

#: A per-record validation metric bounded in [lo, hi] (``trainers.evaluate.BoundedMetric``).
Metric = BoundedMetric

__all__ = [
    "ARRAY_SOURCES",
    "COMPILATION_CACHE_ENV",
    "DATASETS",
    "MODEL_NAMES",
    "Dataset",
    "DatasetNotFoundError",
    "DpSgdSchedule",
    "DpSgdTrainer",
    "Hyperparams",
    "Metric",
    "NnxModel",
    "add_noise",
    "check_user_arrays",
    "clipped_grad_sum",
    "default_compilation_cache_dir",
    "dpsgd_privacy",
    "fix_model",
    "load_dataset",
    "read_npz",
    "shipped_with_lora",
    "suggested_settings",
    "use_compilation_cache",
    "with_lora",
]

log = logging.getLogger("dptune")

#: Hyperparameters that enter a DP-SGD candidate's DpEvent.
DPSGD_PRIVACY_FIELDS = ("noise_multiplier", "batch_size", "epochs", "score_noise_std")


_cache_decided = False


def default_compilation_cache_dir() -> Path:
    """The user's cache folder for dptune's compiled steps: ``cache_root()/jax``
    (``dptune.accounting.calibration``; ``~/.cache/dptune/jax`` unless ``$DPTUNE_CACHE`` or
    ``$XDG_CACHE_HOME`` say otherwise)."""
    return cache_root() / "jax"


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
    if isinstance(setting, str) and setting.strip().lower() in OFF_WORDS:
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


def dpsgd_privacy(
    schedule: DpSgdSchedule, noise_multiplier: float, *, score_noise_std: float | None = None
) -> DpSgdCandidate:
    """The privacy declaration of one DP-SGD run of your own loop, for ``dptune.trainer(privacy=
    ...)``: ``schedule.steps`` Poisson-subsampled Gaussian mechanisms at rate ``schedule.
    sampling_rate`` (both from the PUBLIC size, exactly what ``schedule.batches`` draws) with noise
    multiplier sigma and, in parallel, a noisy validation count of std ``score_noise_std`` (None: no
    private score). The same object the built-in trainer declares (``DpSgdCandidate``)."""
    return dpsgd_candidate(schedule.privacy(noise_multiplier), score_noise_std)


#: Largest standard deviation of a candidate's validation score, in units of the score's range
#: (accuracy units for accuracy), before dptune warns that selection is mostly noise.
MAX_SCORE_NOISE = 0.05

#: Learning-rate ranges (log-uniform) by optimiser. Plain and momentum SGD's are per record of the
#: expected batch: the range is B times these (the linear scaling rule, as Sander et al. 2023
#: scale DP-SGD across batch sizes), because with most per-example gradients clipped the update is
#: about lr * C * (mean direction + noise of std sigma / B), so the product lr * C, not lr or C
#: alone, sets the step, and a larger batch carries a larger one. The ends come from the public
#: tasks of scripts/tuning_landscape.py (docs/privacy_utility.md, "Better defaults"): the best
#: lr * C per record of the batch lay between about 1e-3 and 1e-2 (plain SGD's scale; momentum 0.9
#: moves ten times as far, hence its range is a tenth); from about 2e-2 the LM and the CNN
#: diverged and the other tasks lost 6 to 40 points.
#: Adam's, which normalises the step, are as public recipes report them (Li et al. 2022 fine-tune
#: with Adam at 5e-4; Opacus's tutorials use 1e-3), not scaled.
LEARNING_RATE_RANGES = {"momentum": (5e-5, 1e-3), "sgd": (5e-4, 1e-2), "adam": (1e-4, 1e-2)}


def score_noise(score_noise_std: float | None, expected_validation_size: float) -> float:
    """Standard deviation of a candidate's noisy validation score in units of the score's range
    (accuracy units): ``score_noise_std / expected_validation_size`` (``trainers.evaluate.
    validation_score`` divides a sensitivity-1 sum plus N(0, std^2) by the public expected size);
    0 for an exact score, inf without validation records."""
    if score_noise_std is None:
        return 0.0
    if expected_validation_size <= 0:
        return math.inf
    return float(score_noise_std) / float(expected_validation_size)


def warn_score_noise(score_noise_std: float | None, data: Dataset) -> None:
    """Warns on the curator's console when the validation score's noise exceeds
    ``MAX_SCORE_NOISE`` (from public numbers only: the noise and the expected validation size)."""
    if data.public_num_val <= 0:
        return  # refused with its own message when a candidate is declared
    noise = score_noise(score_noise_std, data.public_num_val)
    if noise > MAX_SCORE_NOISE:
        needed = math.ceil(score_noise_std / MAX_SCORE_NOISE)
        log.warning(
            "the validation score's noise is %.3g score units (noise std %g over %.0f "
            "expected validation records), above %g: selection between candidates is close to "
            "a coin toss. Give at least %d validation records (validation_fraction / "
            "config.data.validation_size) or a public validation set",
            noise, score_noise_std, data.public_num_val, MAX_SCORE_NOISE, needed,
        )  # fmt: skip


def suggested_settings(
    num_examples: int, optimizer: str = "momentum", score_noise_std: float = 10.0
) -> dict[str, Any]:
    """Tuning defaults that fit a dataset of ``num_examples`` (PUBLIC, declared) records and an
    optimiser, from public facts only (docs/your_model.md, "Defaults that fit the model").

    * ``validation_size``: enough records that the score's noise ``score_noise_std / size`` is at
      most ``MAX_SCORE_NOISE``, else 10% of the records up to 1000, and never more than a quarter.
    * ``batch_size``: 256, smaller (a power of two, at least 16) so that an epoch has >= 16 steps.
    * ``epochs``: enough for about 500 steps (DP-SGD gains from many noisy steps, De et al.
      2022), between 10 and 100.
    * ``learning_rate``: :data:`LEARNING_RATE_RANGES` for the optimiser (times the batch size for
      plain and momentum SGD).
    * ``mean_trials``: 4 candidates on average (random stopping), 2 below 2,000 records, where
      each candidate's budget share matters more than the search.
    Returns a dict with those keys (``learning_rate`` a (low, high) pair).
    """
    if optimizer not in LEARNING_RATE_RANGES:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {sorted(LEARNING_RATE_RANGES)}")
    n = int(num_examples)
    if n < 8:
        raise ValueError(f"num_examples={num_examples!r}: too few records to tune on")
    val = max(math.ceil(score_noise_std / MAX_SCORE_NOISE), min(1000, round(0.1 * n)))
    val = min(val, n // 4)
    train = n - val
    batch = 256
    while batch > 16 and train / batch < 16:
        batch //= 2
    epochs = int(min(100, max(10, math.ceil(500 * batch / train))))
    low, high = LEARNING_RATE_RANGES[optimizer]
    scale = 1 if optimizer == "adam" else batch
    return {
        "validation_size": int(val),
        "batch_size": batch,
        "epochs": epochs,
        "learning_rate": (low * scale, high * scale),
        "mean_trials": 4.0 if n >= 2000 else 2.0,
    }


def _failure(result: Any) -> CandidateFailure:
    """A failed ``trainers.spec.CandidateResult`` as the journal's failure record."""
    error = result.error or "NonFiniteParameters: the parameters became non-finite"
    kind, _, message = error.partition(": ")
    return CandidateFailure(kind, message, result.traceback or "")


def _test_key(spec: models.ModelSpec) -> str:
    """The per-epoch curve's key of :meth:`DpSgdTrainer._test_score`."""
    return "test_accuracy" if spec.metric is None else "test_metric"


class DpSgdTrainer(DatasetTrainer):
    """This project's DP-SGD trainer (``trainers.loop``) on an in-memory dataset.

    A candidate computes what the selection consumes (its noisy validation score) and the
    per-epoch privacy of its training (which travels in its payload to the release); the test
    split is evaluated once, for the released candidate (``release_view``).

    Args:
      data: a ``trainers.data.Dataset`` (e.g. ``dptune.Dataset.from_arrays(x, y,
        num_examples=...)``).
      base: default hyperparameters (``trainers.spec.Hyperparams`` fields) that the space's values
        override.
      epoch_progress: whether to show a per-epoch tqdm bar (the curator's console only).
      test_curve: evaluate every candidate on the public test split after each epoch (one
        test-set forward pass per candidate and epoch, about 5 % of an epoch's DP training at
        MNIST sizes) so that the released candidate's curve (``training_curve.png``) shows its
        test metric per epoch beside its epsilon; the other candidates' curves stay in their
        payloads (``DIR/private/``, the curator's). Selection never reads the test split. False
        skips the passes.
      compilation_cache: JAX's persistent compilation cache (:func:`use_compilation_cache`): None
        (automatic: on, in the user's cache folder, unless already decided or
        ``$DPTUNE_COMPILATION_CACHE=off``), False (off) or a folder.
      model: a shipped model name (``trainers.spec.MODEL_NAMES``), a ``flax.linen.Module``
        instance, or an ``(init_fn, apply_fn)`` pair (``init_fn(key, x) -> params``,
        ``apply_fn(params, x) -> outputs``); the input shape and dtype come from ``data``. Default:
        ``base["model"]`` or "cnn26k". A module is checked before anything trains (state other than
        parameters such as BatchNorm statistics, examples mixed in a batch, a per-example loss).
      loss: ``loss(outputs, labels) -> (b,)`` per-example losses (outputs any pytree, labels
        the data's (b, ...) labels); default softmax cross-entropy on integer class labels (n,).
      metric: a ``dptune.Metric(fn, lo, hi)`` (per record, bounded, clipped to [lo, hi]) scoring
        candidates on the validation split; default accuracy (integer class labels only).
        A module with a ``train`` (or ``deterministic``) keyword trains with per-example dropout
        and is evaluated deterministically (``trainers.train_mode``). With a user's model, a
        ``batch_size`` or ``epochs`` missing from ``base`` comes from :func:`suggested_settings`;
        a validation score noisier than ``MAX_SCORE_NOISE`` is warned about.
      grad_impl: per-example clipping: "auto" (a shipped model's hand-tuned path, else the ghost
        path when every parametrised layer is known, else vmap(grad), said once in the log),
        "ghost" or "vmap" to force one ("bookkeeping" / "naive": the old spellings).
      init: public initial parameters (fine-tuning, ``docs/finetune.md``): a params pytree, an
        orbax checkpoint folder, a Flax msgpack file, an ``.npz`` of '/'-joined parameter paths,
        or a dptune release (its workdir or ``release/`` folder). Checked against the model's
        parameter shapes and dtypes before anything runs; for a ``dptune.with_lora`` model the
        base's parameters, the adapters starting fresh; for an NNX model, its ``nnx.Param``
        state as a dict (``dptune.NnxModel(base).params()``), ``nnx.LoRAParam`` factors it
        lacks starting at the module's own values. The statement names the assumption that
        they are public (``public-init``) with their fingerprint.
      trainable: which parameters train: regexes searched in the '/'-joined parameter paths
        (``["Dense_1"]``, ``[".*lora.*"]``), a callable ``(path, leaf) -> bool``, or for an NNX
        model an NNX filter (``nnx.LoRAParam``, ``nnx.PathContains("head")``); the others
        stay bitwise as they start. Default: everything, or a LoRA model's adapters (a
        ``with_lora`` model's, an NNX model's ``nnx.LoRAParam`` factors).
    """

    hyperparams_class = Hyperparams
    kind = "DP-SGD"
    #: The step index each step's noise key is folded with (``trainers.loop.train_candidates``).
    noise_step = staticmethod(loop.same_step)

    privacy_fields = DPSGD_PRIVACY_FIELDS
    #: fields of the space besides ``Hyperparams``: a LoRA model's rank and scale (the model's
    #: structure; privacy-irrelevant)
    extra_hyperparams = ("lora_rank", "lora_scale")
    calibrated_field = "noise_multiplier"
    #: the validation count + Gaussian noise accounted in its privacy (or, on a separate public
    #: validation set, an exact score of public data): covered either way
    score_kind = "covered"

    def __init__(
        self,
        data: Dataset,
        base: Mapping[str, Any] | None = None,
        epoch_progress: bool = True,
        test_curve: bool = True,
        compilation_cache: str | os.PathLike | bool | None = None,
        *,
        model: Any = None,
        loss: Any = None,
        metric: Any = None,
        grad_impl: str = "auto",
        init: Any = None,
        trainable: Any = None,
    ) -> None:
        if not hasattr(data, "public_num_train"):  # e.g. (x, y): the public size is not known
            raise TuningConfigError(
                f"data={type(data).__name__} is not a dptune.Dataset: wrap your arrays with "
                "dptune.Dataset.from_arrays(x, y, num_examples=N) (N: the public record count)"
            )
        self.data = data
        self.test_curve = test_curve
        self.base = dict(base or {})
        # The PUBLIC nominal training size (declared or published), never len() of private arrays.
        self.num_examples = int(data.public_num_train)
        self.epoch_progress = epoch_progress
        self.compilation_cache = compilation_cache
        if grad_impl not in step_lib.GRAD_IMPLS:
            raise TuningConfigError(
                f"grad_impl={grad_impl!r} must be one of {step_lib.GRAD_IMPLS[:3]}"
            )
        self.grad_impl = grad_impl
        if model is not None or loss is not None or metric is not None:
            self.base["model"] = self._model_spec(model, loss, metric)
        self.model = self.base.get("model", "cnn26k")
        if isinstance(self.model, str) and not data.class_labels:
            raise TuningConfigError(
                f"dptune: the data's labels are {data.train_y.dtype}{data.train_y.shape[1:]} per "
                f"record, not integer class ids: the shipped model {self.model!r} and its default "
                "loss and accuracy need class labels (n,). Pass model=<your flax Module>, "
                "loss=fn(outputs, labels) -> (b,) and metric=dptune.Metric(fn, lo, hi)"
            )
        if isinstance(self.model, models.ModelSpec) and not self.model.shipped:
            # A user's model: batch size and epochs, where not given, fit the declared size.
            optimizer = self.base.get("optimizer", Hyperparams.optimizer)
            suggested = suggested_settings(
                self.num_examples + max(0, round(data.public_num_val)),
                optimizer if optimizer in LEARNING_RATE_RANGES else "sgd",
            )  # fmt: skip
            for name in ("batch_size", "epochs"):
                self.base.setdefault(name, suggested[name])
        warn_score_noise(self._score_noise_std(), data)
        #: the initial parameters' fingerprint (``trainers.finetune.fingerprint``), or None
        self.init_fingerprint: str | None = None
        self._finetune: tuple[Any, Any] | None = None  # (checked init, trainable) for variants
        self._variants: dict[tuple, Any] = {}
        # A LoRA model given here (with_lora, or an NNX model with nnx.LoRAParam factors) trains
        # its adapters by default, with or without init= (with_lora's targets are checked now,
        # before anything is charged).
        held = getattr(self.model, "module", None)
        adapted = model is not None and (
            isinstance(held, lora.LoRA) or isinstance(held, NnxModel) and held.has_adapters()
        )
        if init is not None or trainable is not None or adapted:
            try:
                self.base["model"] = self._finetune_spec(self.model, init, trainable)
            except ValueError as e:
                raise TuningConfigError(str(e)) from None
            self.model = self.base["model"]
        module = getattr(self.model, "module", None)
        if model is not None and isinstance(module, NnxModel):
            # An NNX module starts every candidate from its own values (a base the user may
            # have loaded pretrained): named and assumed public, as a start given by init= is.
            flat = (self._finetune or (None,))[0]
            start = flat if flat is not None else finetune.flat_paths(module.params())
            self.init_fingerprint = finetune.fingerprint({**start, **module.held_params()})
        if grad_impl in ("ghost", "bookkeeping"):
            try:  # a forced path that does not apply is refused before anything private runs
                step_lib.resolve_grad_impl(
                    models.resolve(self.model, data.num_classes), grad_impl, data.image_shape
                )
            except ValueError as e:
                raise TuningConfigError(str(e)) from None
            trains_part = getattr(self.model, "trainable", None) is not None
            if grad_impl == "bookkeeping" and trains_part:
                raise TuningConfigError(
                    "grad_impl='bookkeeping' trains every parameter; with trainable=... use "
                    "'auto', 'ghost' or 'vmap'"
                )

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
        x, y = self.data.train_x, self.data.train_y
        try:
            return models.user_model(
                model, x.shape[1:], x.dtype, loss=loss, metric=metric,
                num_classes=self.data.num_classes or None, label_shape=y.shape[1:],
                label_dtype=y.dtype, input_layout=self.data.input_layout,
            )  # fmt: skip
        except (TypeError, ValueError) as e:
            raise TuningConfigError(str(e)) from None

    def _score_noise_std(self) -> float | None:
        """The base setting's validation-score noise (Hyperparams' default unless overridden)."""
        if "score_noise_std" in self.base:
            return self.base["score_noise_std"]
        return Hyperparams.__dataclass_fields__["score_noise_std"].default

    def _finetune_spec(self, model: Any, init: Any, trainable: Any) -> models.ModelSpec:
        """``model`` as a spec that starts from ``init`` and trains ``trainable``
        (``trainers.finetune``); raises ValueError in one line naming the keyword."""
        spec = models.resolve(model, self.data.num_classes)
        if init is not None and spec.features is not None:
            raise ValueError(f"init= is not supported for model {spec.name!r} (it reads features)")
        shapes = jax.eval_shape(lambda: models.init_params(spec, jax.random.PRNGKey(0)))
        adapted = isinstance(spec.module, lora.LoRA)
        on_nnx = isinstance(spec.module, NnxModel)
        if adapted:
            x = jax.ShapeDtypeStruct((1, *spec.input_shape), spec.input_dtype)
            try:  # a target that adapts nothing is refused
                lora.targeted_layers(spec.module, x)
            except ValueError as e:
                m = spec.module
                raise ValueError(
                    f"model=with_lora({type(m.base).__name__}, targets={list(m.targets)}): {e}"
                ) from None
        flat = None
        if init is not None:
            source = _release_checkpoint(init)
            try:
                given = finetune.read_init(source)
                held = spec.module.held_params() if on_nnx else {}
                if taken := next((p for p in finetune.flat_paths(given) if p in held), None):
                    raise ValueError(
                        f"{taken!r} is held by dptune.NnxModel(module, trainable=...) at the "
                        "module's value, not trained, so init= cannot set it: load it into the "
                        "module, or pass DpSgdTrainer(..., model=module, trainable=filter)"
                    )
                fresh = lora.is_adapter if adapted else spec.module.is_adapter if on_nnx else None
                flat = finetune.match_init(given, shapes, fresh)
            except ValueError as e:
                named = repr(str(init)) if isinstance(init, (str, os.PathLike)) else None
                raise ValueError(f"init={named or f'<{type(init).__name__}>'}: {e}") from None
            self.init_fingerprint = finetune.fingerprint(flat)
        if trainable is None and adapted:
            trainable = lora.TRAINABLE
        elif trainable is None and on_nnx and spec.module.has_adapters():
            # as for with_lora: a model built with LoRA factors trains them, its base stays
            log.info("model=%s has nnx.LoRAParam factors: they train (trainable=nnx.LoRAParam); "
                     "pass trainable= to train more", spec.name)  # fmt: skip
            trainable = nnx.LoRAParam
        lora_filter = trainable is nnx.LoRAParam
        if on_nnx and finetune.is_nnx_filter(trainable):  # e.g. nnx.LoRAParam: by Variable type
            trainable = spec.module.selects(trainable)
        try:
            mask = finetune.trainable_mask(shapes, trainable)
        except ValueError as e:
            no_lora = on_nnx and lora_filter and "matches no parameter" in str(e)
            raise ValueError(
                f"{e}; the model has no LoRA factors: build its layers as nnx.LoRALinear(..., "
                "lora_rank=r) or wrap them in nnx.LoRA"
                if no_lora
                else str(e)
            ) from None
        self._finetune = (flat, trainable)
        whole = finetune.all_trainable(mask)
        return dataclasses.replace(
            spec, init=flat, trainable=None if whole else mask, shipped=spec.shipped and whole
        )

    def _lora_variant(self, spec: models.ModelSpec, rank: Any, scale: Any) -> models.ModelSpec:
        """The LoRA model ``spec`` at another rank or scale (privacy-irrelevant fields of the
        space), built once per (rank, scale) so candidates share its compiled step."""
        if not isinstance(spec.module, lora.LoRA):
            raise TuningConfigError(
                "lora_rank / lora_scale are fields of a LoRA model: pass "
                "model=dptune.with_lora(module, rank=..., targets=[...])"
            )
        m = spec.module
        rank = m.rank if rank is None else rank
        scale = m.scale if scale is None else float(scale)
        key = (rank, scale)
        if key not in self._variants:
            try:
                module = lora.with_lora(m.base, rank, m.targets, scale)
            except ValueError as e:
                raise TuningConfigError(f"lora_rank={rank!r}: {e}") from None
            variant = dataclasses.replace(spec, module=module, init=None, trainable=None)
            flat, trainable = self._finetune or (None, None)
            shapes = jax.eval_shape(lambda: models.init_params(variant, jax.random.PRNGKey(0)))
            if flat is not None:  # adapters in init= (e.g. a LoRA release) fix their rank
                try:
                    finetune.match_init(flat, shapes, lora.is_adapter)
                except ValueError as e:
                    raise TuningConfigError(
                        f"lora_rank={rank!r}: init= holds adapters of another rank: {e}"
                    ) from None
            mask = finetune.trainable_mask(shapes, trainable or lora.TRAINABLE)
            whole = finetune.all_trainable(mask)
            self._variants[key] = dataclasses.replace(
                variant, init=flat, trainable=None if whole else mask
            )
        return self._variants[key]

    #: Every candidate's expected batch size is multiplied by this (rounded, at least 1): 1 on the
    #: full data; ``fraction`` on a subset (``subset``), so a candidate on the subset keeps the
    #: full run's sampling rate and number of steps.
    batch_scale: float = 1.0

    def hyperparams(self, hparams: Mapping[str, Any]) -> Hyperparams:
        hparams = dict(hparams)
        rank, scale = hparams.pop("lora_rank", None), hparams.pop("lora_scale", None)
        if rank is not None or scale is not None:
            spec = models.resolve(hparams.get("model", self.model), self.data.num_classes)
            hparams["model"] = self._lora_variant(spec, rank, scale)
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
            subset_dataset(self.data, fraction, key), self.base, self.epoch_progress, False,
            self.compilation_cache, grad_impl=self.grad_impl,
        )  # fmt: skip
        out.batch_scale = self.batch_scale * float(fraction)
        out.init_fingerprint, out._finetune = self.init_fingerprint, self._finetune
        return out

    def _privacy(
        self, hp: Hyperparams, steps: int | None = None, drawn: Collection[str] = ()
    ) -> DpSgdCandidate:
        """``hp``'s candidate (training of ``steps`` steps if given); ``drawn``: the space's
        fields, named ``--config.space.`` in a refusal (the others ``--config.train.``)."""
        if self.data.public_num_val <= 0:  # public: refused before anything is accounted
            raise TuningConfigError(
                "the dataset has no validation set (validation_size=0): candidates cannot be "
                "scored; set config.data.validation_size > 0 or supply a validation_dir"
            )
        if hp.score_noise_std is None and not self.data.validation_public:
            raise TuningConfigError(
                "score_noise_std=None (an exact validation score) needs a validation set declared "
                "public and separate from the private data, but this dataset's validation split "
                "is private: set score_noise_std > 0 (config.train.score_noise_std), or load a "
                "separate public validation set (config.data.validation_dir with "
                "config.data.validation_public=True)"
            )
        if hp.batch_size > (n := self.num_examples):  # public sizes: B / N must be a rate <= 1
            why = (
                f"batch_size={hp.batch_size} exceeds the {n} public training records (the "
                f"sampling rate B / N must be at most 1): lower it to {n} or less"
            )
            raise TuningConfigError(why, command=config_section("batch_size", drawn) + why)
        try:
            privacy = _hp_privacy(hp, self.num_examples)
        except ValueError as e:
            raise TuningConfigError(f"invalid DP-SGD setting: {e}") from None
        if steps is not None:
            privacy = type(privacy)(privacy.sampling_rate, int(steps), privacy.noise_multiplier)
        return dpsgd_candidate(privacy, hp.score_noise_std)

    def privacy(self, hparams: Mapping[str, Any]) -> DpSgdCandidate:
        """The candidate's privacy: ``steps`` Poisson-subsampled Gaussian steps at q = B / N_public
        and, in parallel, the noisy validation count."""
        return self._privacy(self.hyperparams(hparams), drawn=hparams)

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
        never printed: whether a call had two candidates to vectorise depends on K), and
        ``dropped_nonfinite``: ``CandidateResult.dropped``, the sampled examples whose gradient
        norm was not finite, left out of the clipped sums (a count of private records: shown by
        ``dptune inspect``, never logged, never in the release view)."""
        use_compilation_cache(self.compilation_cache)
        hps = [self.hyperparams(h) for h in hparams]
        impl = None if self.grad_impl == "auto" else self.grad_impl
        choice = probe.choose_for(
            hps, self.data.num_classes, self.data.train_x.shape[1:], grad_impl=impl
        )
        execution: dict[str, Any] = {"vectorized": bool(choice and choice.vectorize)}
        if choice is not None:
            execution.update(probe=dataclasses.asdict(choice), reason=choice.describe())
        # The full 64 bits of a threefry key, drawn from the candidate's (OS-entropy) generator:
        # the DP noise must not be guessable from a small seed space.
        keys = [r.integers(0, 2**32, size=2, dtype=np.uint32) for r in rngs]
        # Per-epoch test metric on the public split: the released candidate's is its curve.
        test_curve: dict[int, dict[int, float]] = {}

        def on_epoch(i: int, epoch: int, params: Any) -> None:
            self.epoch_hook(i, epoch, params)
            if with_curve:
                test_curve.setdefault(i, {})[epoch] = self._test_score(specs[i], params)

        with_curve = self.test_curve and len(self.data.test_y) > 0
        specs = [models.resolve(hp.model, self.data.num_classes) for hp in hps]
        # The per-epoch callback only where something reads the parameters after each epoch (test
        # curves on request, a subclass's epoch_hook such as the audit's); else none.
        hooked = type(self).epoch_hook is not DpSgdTrainer.epoch_hook
        with epoch_bar(self.epoch_progress, sum(hp.epochs for hp in hps)) as progress:
            results = loop.train_candidates(
                hps, self.data, keys, progress=progress,
                on_epoch=on_epoch if with_curve or hooked else None,
                vectorize=execution["vectorized"], grad_impl=self.grad_impl,
                noise_step=self.noise_step,
            )  # fmt: skip
        out: list[tuple[float, Any]] = []
        for i, r in enumerate(results):
            if r.failed:
                # The curator's console: which error, not which score (a failure is data-dependent).
                failure = _failure(r)
                log.warning("a candidate failed: %s", failure.summary())
                out.append((float("nan"), failure))
                continue
            curve = test_curve.get(i, {})
            key = _test_key(specs[i])
            history = [
                {**h, **({key: curve[h["epoch"]]} if h.get("epoch") in curve else {})}
                for h in r.history
            ]
            payload = {
                "params": jax.tree_util.tree_map(np.asarray, r.params),
                "history": history,
                "privacy_by_epoch": self._privacy_curve(hps[i], history),
                "execution": execution,
                "dropped_nonfinite": int(r.dropped),
            }
            out.append((float(r.validation_score), payload))
        return out

    def _privacy_curve(self, hp: Hyperparams, history: Sequence[Mapping[str, Any]]) -> list:
        """The accounting candidate of the training up to each epoch of ``history``; empty (no
        curve) for a setting the accountant refuses, which only an audit's negative control (no
        noise) can train: a tuning run's plan refuses it before anything trains."""
        try:
            return [self._privacy(hp, h["steps"]) for h in history if "steps" in h]
        except TuningConfigError:
            return []

    def check_inputs(self, hparams: Mapping[str, Any]) -> None:
        """Refuses, before any private computation, a candidate the loop would refuse when it
        starts (e.g. a model whose input shape is not the images'): public schema only."""
        hp = self.hyperparams(hparams)  # its refusal in its own words (command's included)
        try:
            loop.check_inputs(hp, self.data)
        except ValueError as e:
            # A model named by its name is config.train's or .space's (config.model's is a spec).
            rest, command = str(e).removeprefix(f"model {hp.model!r}"), None
            if isinstance(hp.model, str) and rest != str(e):
                section = config_section("model", hparams)
                command = (f"{section}model={hp.model!r} (the config's model; "
                           f"--config.model=pkg.module:factory trains yours){rest}")  # fmt: skip
            raise TuningConfigError(str(e), command=command) from None

    def code_digest(self) -> str:
        """This module and the ``trainers`` package's sources (the DP-SGD engine)."""
        package = Path(loop.__file__).parent
        return source_digest(files=[Path(__file__), *sorted(package.glob("*.py"))])

    def epoch_hook(self, index: int, epoch: int, params: Any) -> None:
        """Called with candidate ``index``'s (private) parameters after each epoch of
        ``train_many``; nothing here (the audit's subclass reads its canaries there)."""

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
        spec = models.resolve(self.hyperparams(hparams).model, self.data.num_classes)
        test = history[-1].get(_test_key(spec)) if history else None
        if test is None and len(self.data.test_y):
            test = self._test_score(spec, payload["params"])
        metric = spec.metric
        return ReleaseView(
            {"params": payload["params"]},
            test_accuracy=test if metric is None else None,
            test_metric=None if metric is None else {"name": metric.name, "value": test},
            history=history,
            privacy_by_epoch=privacy if len(privacy) == len(history) else (),
        )

    def _test_score(self, spec: models.ModelSpec, params: Any) -> float:
        """What candidates are scored by, on the public test split: accuracy, or for a model with
        its own ``Metric`` that metric in its units (arg-max accuracy means nothing for, e.g., a
        regression output)."""
        x, y = self.data.test_x, self.data.test_y
        if spec.metric is None:
            return float(evaluate(params, spec, x, y))
        return float(evaluate_metric(params, spec, x, y))

    def privacy_notes(self) -> list[str]:
        """Sentences for the privacy statement: how the validation split was formed, which
        public size the sampling rate comes from, and (fine-tuning) the public start."""
        notes = [
            self.data.describe_split() + ".",
            f"Sampling rates and step counts use the public nominal training size "
            f"{self.num_examples}, not the private data's length.",
        ]
        if self.init_fingerprint is not None:
            notes.append(
                f"Training starts from initial parameters with fingerprint "
                f"{self.init_fingerprint}, assumed public (independent of the private data)."
            )
        mask = getattr(self.model, "trainable", None)
        if mask is not None:  # part of the model trains (frozen layers, LoRA adapters)
            flags = finetune.flat_paths(mask)
            trained = [path for path, on in flags.items() if on]
            listed = ", ".join(trained[:4]) + (", ..." if len(trained) > 4 else "")
            notes.append(
                f"Only {len(trained)} of {len(flags)} parameter arrays train ({listed}); the "
                "others stay bit for bit at the start, and the released checkpoint holds all."
            )
        return notes

    def privacy_checks(self) -> list[str]:
        """What dptune's own code guarantees for these candidates (the statement's "Checked by
        dptune")."""
        checks = [
            "DP-SGD is dptune's own code (trainers/): per-example clipping to clip_norm, Poisson "
            f"sampling at q = batch_size / {self.num_examples} (the public size), Gaussian noise "
            "of std noise_multiplier x clip_norm once per step, and the validation count plus "
            "Gaussian noise over the public expected validation size (tests/trainers)",
            "the validation split is per record (a keyed hash of each record) or a separate file "
            "(trainers.data)",
        ]
        if isinstance(self.model, models.ModelSpec) and not self.model.shipped:
            metric = self.model.metric
            checks.append(
                f"the model ({self.model.name}) is the user's; dptune checked it before training "
                "(no state besides its parameters; one example's outputs do not move with another "
                "example's, on synthetic inputs) and clips its per-example gradients itself"
                + (
                    ""
                    if metric is None
                    else f"; its validation metric is clipped to [{metric.lo:g}, {metric.hi:g}] "
                    "and rescaled to [0, 1] per record, so the noisy sum has sensitivity 1"
                )
            )
        return checks

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

    def clipping_path(self) -> dict[str, Any]:
        """How per-example gradients are clipped in this run, and why not faster: ``{"path":
        "bookkeeping" | "ghost" | "vmap", "why": str}``. Decided from the model and the input's
        shape alone (``trainers.step.resolve_grad_impl``), never from data; logged once per run
        and kept in the curator's view (``dptune inspect``)."""
        spec = models.resolve(self.model, self.data.num_classes)
        augmult = int(self.base.get("augmult", 0) or 0)
        impl = step_lib.resolve_grad_impl(spec, self.grad_impl, self.data.image_shape, augmult)
        if impl == "bookkeeping":
            why = f"the hand-tuned path of the shipped model {spec.name}"
        elif impl == "ghost":
            plan = step_lib.ghost_plan(spec)
            why = f"every parametrised layer is a known layer ({len(plan.layers)} layers)"
        elif self.grad_impl in ("vmap", "naive"):
            why = "grad_impl='vmap' was asked for"
        elif spec.shipped and spec.name != "wrn16_4":  # wrn16_4: the ghost plan's reason
            why = f"the shipped model {spec.name} has no fast path for this input or augmult"
        else:
            why = f"the ghost path does not apply: {step_lib.ghost_plan(spec).reason}"
        return {"path": impl, "why": why}

    def describe(self) -> dict[str, Any]:
        """What the journal binds a workdir to (JSON-safe, stable across processes)."""
        base = dict(self.base)
        if "model" in base and not isinstance(base["model"], str):
            base["model"] = describe_model(base["model"])
        out = {
            "kind": "dpsgd",
            "dataset": self.data.name,
            **({"init": self.init_fingerprint} if self.init_fingerprint else {}),
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
        "class": qualname(getattr(spec.module, "module_class", type(spec.module)))  # NNX: its own
        if spec.module is not None
        else qualname(spec.apply_fn),
        "input": [list(spec.input_shape), spec.input_dtype],
        "params": {jax.tree_util.keystr(k): list(v.shape) for k, v in flat},
    }
    # Only where they differ from the defaults, so earlier descriptions stay the same.
    if spec.input_layout is not None:
        out["input_layout"] = spec.input_layout.describe()
    if spec.label_shape != () or spec.label_dtype != "int32":
        out["labels"] = [list(spec.label_shape), spec.label_dtype]
    if spec.call_keyword is not None:
        out["call_keyword"] = spec.call_keyword
    if spec.trainable is not None:
        out["trainable"] = [p for p, m in finetune.flat_paths(spec.trainable).items() if m]
    if spec.loss is not None:
        out["loss"] = qualname(spec.loss)
    if spec.metric is not None:
        m = spec.metric
        out["metric"] = {"fn": qualname(m.fn), "lo": float(m.lo), "hi": float(m.hi)}
    return out


def with_lora(
    module: Any, rank: int, targets: Sequence[str] | str, scale: float = 1.0
) -> lora.LoRA:
    """``module`` (an unbound ``flax.linen`` Module) with rank-``rank`` LoRA adapters on its
    Dense / DenseGeneral / Conv / Embed layers whose '/'-joined module path matches one of
    ``targets`` (``trainers.lora.with_lora``; ``docs/finetune.md``).

    Raises:
      TuningConfigError: rank < 1, no targets, a target that is not a regex, or a module that
        is not an unbound linen Module, in one line naming the keyword (a target that matches
        no layer is refused by ``DpSgdTrainer``, which knows the input).
    """
    try:
        return lora.with_lora(module, rank, targets, scale)
    except ValueError as e:
        raise TuningConfigError(str(e)) from None


def shipped_with_lora(
    name: str, num_classes: int, rank: int, targets: Sequence[str], scale: float = 1.0
) -> Any:
    """The shipped model ``name`` (``MODEL_NAMES``) with ``num_classes`` outputs and rank-``rank``
    LoRA adapters on its layers matching ``targets`` (:func:`with_lora`)."""
    try:
        module = models.get_model(name, num_classes).module
    except ValueError as e:
        raise TuningConfigError(str(e)) from None
    return with_lora(module, rank, targets, scale)


def _release_checkpoint(init: Any) -> Any:
    """A dptune release (a run's workdir or its ``release/`` folder) as the orbax checkpoint
    folder that holds its parameters; anything else as it is."""
    if not isinstance(init, (str, os.PathLike)) or not str(init):
        return init
    folder = Path(init).expanduser()
    for release in (folder, folder / "release"):
        if (release / "result.json").is_file():
            if not (release / "checkpoint").is_dir():
                raise TuningConfigError(f"init={str(init)!r}: the release holds no parameters")
            return release / "checkpoint"
    return init
