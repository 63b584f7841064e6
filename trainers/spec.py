"""What a DP-SGD candidate is, without JAX: its hyperparameters, the privacy parameters they imply,
and the shape of its result.

The privacy of a run is that of ``steps`` compositions of the Poisson-subsampled Gaussian mechanism
with rate q and noise multiplier sigma. :func:`dpsgd_privacy` returns exactly those numbers from the
hyperparameters and the PUBLIC nominal training size; the training loop (``trainers.loop``) takes
its step count and sampling rate from the same function, so the accountant and the trainer cannot
disagree. ``dptune.accounting.events.DpSgdCandidate`` turns them into a dp_accounting DpEvent.

Importing this module does not import JAX (a test checks), so accounting and config checks run
without it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

#: Score of a failed candidate (NaN/inf parameters, or an error during training): NaN, the one
#: failure encoding of dptune and ``selection`` (it ranks below every score). Fixed and
#: data-independent, as the selection theorems require of a candidate's output.
FAILURE_SCORE = float("nan")

OPTIMIZERS = ("sgd", "momentum", "adam")
#: Model names of ``trainers.models.get_model``.
MODEL_NAMES = ("cnn26k", "cnn52k", "cifar_cnn", "wrn16_4", "scatter_linear", "scatter_cnn")
#: The name of a model wrapped with the gradient canaries of ``dptune audit`` ends so
#: (``trainers.audit.gradient_canary_spec``); never a model to release.
AUDIT_MODEL_SUFFIX = "+gradient_canaries"


@dataclasses.dataclass(frozen=True)
class Hyperparams:
    """Hyperparameters of one DP-SGD candidate.

    Attributes:
      learning_rate: optimiser step size (> 0).
      clip_norm: C, the L2 bound on each per-example gradient (> 0).
      noise_multiplier: sigma; the noise on the clipped sum has std sigma * C per coordinate (>= 0).
      batch_size: B, the *expected* batch size under Poisson sampling; the sampling rate is B / N.
      epochs: passes over the training set; the run has epochs * ceil(N / B) steps.
      optimizer: "sgd", "momentum" (heavy ball, optax.sgd with momentum) or "adam".
      momentum: momentum coefficient for "momentum" (in [0, 1)).
      model: one of ``MODEL_NAMES``: "cnn26k", "cnn52k", "cifar_cnn", "wrn16_4", or
        "scatter_linear" / "scatter_cnn" (trained on the images' scattering features), or a
        user's model as a ``trainers.models.ModelSpec`` (``trainers.models.user_model``). Privacy
        is the same function of (B, epochs, sigma) whichever model is chosen.
      score_noise_std: std, in counts, of the Gaussian noise added to the number of correct
        validation predictions (default 10: private by default). None = exact score, allowed only
        on a validation set declared public and separate from the private data.
      augmult: augmentation multiplicity K (De et al. 2022, §3.1). 0: no augmentation (each
        example as it is). K >= 1: every sampled example is replaced by K random copies (crop of the
        4-pixel reflect-padded image, left-right flip with probability 1/2), and the example's
        gradient is the mean of its K copies' gradients, clipped once. Privacy is unchanged by K:
        each example still contributes exactly one gradient of norm <= C to the sum, so the
        sensitivity and the accountant's (q, steps, sigma) are the same for every K. Costs ~K
        times the compute per step.
      ema_decay: None, or the decay d in [0, 1) of an exponential moving average of the parameters
        (De et al. 2022, §3.1), warmed up as min(d, (1 + t) / (10 + t)) at step t. The average
        (not the last iterate) is then scored and returned. Post-processing: no privacy cost.
      microbatch_size: most examples per compiled chunk of a step (the per-example work of a batch
        is done chunk by chunk and summed, so memory is bounded by one chunk whatever B is); None:
        :func:`default_microbatch_size`. Changes speed and memory, never the result (up to float
        rounding).
    """

    learning_rate: float = 2.0
    clip_norm: float = 1.0
    noise_multiplier: float = 1.1
    batch_size: int = 256
    epochs: int = 5
    optimizer: str = "sgd"
    momentum: float = 0.9
    model: Any = "cnn26k"
    score_noise_std: float | None = 10.0
    augmult: int = 0
    ema_decay: float | None = None
    microbatch_size: int | None = None

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"Hyperparams.{field}={getattr(self, field)!r}: {why}")

        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            bad("learning_rate", "must be a finite number > 0")
        if not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            bad("clip_norm", "must be a finite number > 0")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            bad("noise_multiplier", "must be a finite number >= 0")
        if int(self.batch_size) != self.batch_size or self.batch_size < 1:
            bad("batch_size", "must be a positive integer")
        if int(self.epochs) != self.epochs or self.epochs < 1:
            bad("epochs", "must be a positive integer")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"must be one of {OPTIMIZERS}")
        if not 0 <= self.momentum < 1:
            bad("momentum", "must be in [0, 1)")
        if isinstance(self.model, str):
            if self.model not in MODEL_NAMES:
                bad("model", f"must be one of {MODEL_NAMES} or a user's model")
        elif not (hasattr(self.model, "input_shape") and hasattr(self.model, "apply")):
            bad("model", "must be a shipped model name or a trainers.models.ModelSpec")
        if self.score_noise_std is not None and not (
            self.score_noise_std > 0 and math.isfinite(self.score_noise_std)
        ):
            bad("score_noise_std", "must be None (exact score) or a finite number > 0")
        if int(self.augmult) != self.augmult or self.augmult < 0:
            bad("augmult", "must be an integer >= 0 (0: no augmentation)")
        if self.ema_decay is not None and not 0 <= self.ema_decay < 1:
            bad("ema_decay", "must be None (no averaging) or in [0, 1)")
        if self.microbatch_size is not None and (
            int(self.microbatch_size) != self.microbatch_size or self.microbatch_size < 8
        ):
            bad("microbatch_size", "must be None (automatic) or an integer >= 8")


@dataclasses.dataclass(frozen=True)
class DpSgdPrivacy:
    """What the accountant needs about one DP-SGD run: ``steps`` Poisson-subsampled Gaussian
    mechanisms."""

    sampling_rate: float
    steps: int
    noise_multiplier: float


def steps_per_epoch(batch_size: int, num_train: int) -> int:
    """ceil(N / B): the number of Poisson steps that touch each example once in expectation (or
    slightly more)."""
    return max(1, math.ceil(num_train / batch_size))


@dataclasses.dataclass(frozen=True)
class DpSgdSchedule:
    """The sampling schedule of one DP-SGD run, from PUBLIC numbers only: q = B / N and
    ``epochs * ceil(N / B)`` Poisson steps. The training loop (``trainers.loop``) takes its
    sampling rate and step count from it and the accountant's declaration comes from
    :meth:`privacy`, so the two cannot disagree; a user's own loop uses the same object
    (``docs/your_model.md``).

    Attributes:
      num_examples: N, the PUBLIC nominal number of training records (``Dataset.public_num_train``),
        never ``len()`` of the private arrays.
      batch_size: B, the expected batch size.
      epochs: passes over the data.
    """

    num_examples: int
    batch_size: int
    epochs: int

    def __post_init__(self):
        for name in ("num_examples", "batch_size", "epochs"):
            v = getattr(self, name)
            if getattr(v, "shape", ()):  # the private data passed where its public size goes
                raise ValueError(
                    f"DpSgdSchedule({name}=<array of shape {tuple(v.shape)}>): pass the PUBLIC "
                    "number (an int you would publish, e.g. Dataset.public_num_train), not data"
                )
            try:
                ok = not isinstance(v, (bool, str)) and int(v) == v and v >= 1
            except (TypeError, ValueError, OverflowError):
                ok = False
            if not ok:
                raise ValueError(f"DpSgdSchedule({name}={v!r}): must be a positive integer")
        if self.num_examples < self.batch_size:
            raise ValueError(
                f"DpSgdSchedule(num_examples={self.num_examples} < batch_size={self.batch_size}): "
                "the expected batch size must not exceed the public number of training records"
            )

    @classmethod
    def from_hyperparams(cls, hp: Hyperparams, num_examples: int) -> DpSgdSchedule:
        return cls(int(num_examples), int(hp.batch_size), int(hp.epochs))

    @property
    def sampling_rate(self) -> float:
        """q = B / N: each record joins a step's batch independently with this probability."""
        return self.batch_size / self.num_examples

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.batch_size, self.num_examples)

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def privacy(self, noise_multiplier: float) -> DpSgdPrivacy:
        """``steps`` Poisson-subsampled Gaussian mechanisms at rate q with this noise multiplier."""
        try:
            sigma = float(noise_multiplier)
        except (TypeError, ValueError):
            raise ValueError(
                f"noise_multiplier={noise_multiplier!r}: a number is needed (in dptune.tune, "
                "privacy= receives the calibrated value in place of 'auto')"
            ) from None
        return DpSgdPrivacy(self.sampling_rate, self.steps, sigma)

    def sampler(self, num_records: int, rng: Any, max_chunk: int = 256) -> Any:
        """A ``trainers.sampling.PoissonSampler`` over the ``num_records`` records actually held
        (each included with probability q, the accountant's rate), with chunks of at most
        ``max_chunk`` slots. ``rng``: a numpy Generator seeded from secret entropy."""
        import numpy as np

        from trainers.sampling import PoissonSampler  # scipy: only when sampling

        if getattr(num_records, "shape", ()):
            raise ValueError(
                f"num_records=<array of shape {tuple(num_records.shape)}>: pass len(x), the "
                "number of records held"
            )
        if not isinstance(rng, np.random.Generator):
            raise ValueError(
                f"rng={rng!r:.60}: pass a numpy Generator seeded from secret entropy, e.g. "
                "np.random.default_rng() (the tuner's rng argument is one)"
            )
        return PoissonSampler(
            num_records, self.batch_size, rng, sampling_rate=self.sampling_rate,
            max_chunk=max_chunk,
        )  # fmt: skip

    def batches(self, num_records: int, rng: Any, max_chunk: int = 256):
        """The run's ``steps`` Poisson batches, each as a list of (idx int32, mask float32)
        chunks of fixed sizes (padding: index 0, mask 0), so a jitted step never recompiles."""
        sampler = self.sampler(num_records, rng, max_chunk)
        for _ in range(self.steps):
            yield sampler.chunks(sampler.sample())


def dpsgd_privacy(hp: Hyperparams, num_train: int) -> DpSgdPrivacy:
    """The DP-SGD parameters of a candidate: the single source of truth.

    ``num_train`` must be PUBLIC: the dataset's nominal size (``Dataset.public_num_train``), never
    ``len()`` of the private arrays, whose length changes when one person is added or removed.
    q = B / N (Poisson sampling rate), steps = epochs * ceil(N / B), sigma = noise_multiplier.
    """
    return DpSgdSchedule.from_hyperparams(hp, num_train).privacy(hp.noise_multiplier)


@dataclasses.dataclass(eq=False)
class CandidateResult:
    """Outcome of one candidate. Private to the curator: only the tuner decides what to release.

    Attributes:
      params: trained flax parameters (numpy arrays), or the last finite ones if the run failed.
      validation_score: validation accuracy in [0, 1], with Gaussian noise on the correct count when
        ``hp.score_noise_std`` is set; ``FAILURE_SCORE`` if failed.
      history: one dict per completed epoch: epoch, steps, train_loss (mean over the epoch's sampled
        examples), seconds.
      failed: True if the parameters became NaN/inf or training raised.
      error: why it failed, ``"Type: message"`` (the exception's, or ``NonFiniteParameters``), else
        None.
      traceback: the exception's formatted traceback if training raised, else None.
      dropped: how many sampled examples (mask > 0; a record counts once per step it is sampled
        in) had a gradient norm that is not finite and were left out of the clipped sums, over
        the epochs that ended with finite parameters. It depends on private records: for the
        curator only, never released.
    """

    params: Any
    validation_score: float
    history: list[dict]
    failed: bool
    error: str | None = None
    traceback: str | None = None
    dropped: int = 0
