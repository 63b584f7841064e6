"""DP-SGD candidates: hyperparameters, the privacy parameters they imply, and training one or K
candidates.

One DP-SGD step (Abadi et al. 2016, Algorithm 1, with Poisson sampling as the accountant assumes):
  1. draw a Poisson batch (each of the N training examples independently with probability
     q = B / N);
  2. clip every per-example gradient to L2 norm C and sum;
  3. add Gaussian noise N(0, (sigma C)^2 I);
  4. divide by the *expected* batch size B (not the realised one, which would leak the batch size)
     and hand the result to an optax optimiser.

The privacy of a whole run is that of ``steps`` compositions of the Poisson-subsampled Gaussian
mechanism with rate q and noise multiplier sigma: :func:`dpsgd_privacy` returns exactly those
numbers, and the trainer uses the same function to decide its step count, so the accountant and the
trainer cannot disagree.

Everything a :class:`CandidateResult` holds (parameters, exact losses, history) is private to the
curator; only the tuner decides what to release.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainers import dpsgd, models
from trainers.data import Dataset
from trainers.runtime import tune_malloc
from trainers.sampling import PoissonSampler

log = logging.getLogger(__name__)

# Score of a failed candidate (NaN/inf parameters, or an error during training): NaN, the one
# failure encoding of dptune and ``selection`` (it ranks below every score). Fixed and
# data-independent, as the selection theorems require of a candidate's output.
FAILURE_SCORE = float("nan")

OPTIMIZERS = ("sgd", "momentum", "adam")
Progress = Callable[[dict], None]


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
      model: one of ``trainers.models.MODEL_NAMES``: "cnn26k", "cnn52k", "cifar_cnn", or
        "scatter_linear" / "scatter_cnn" (trained on the images' scattering features; privacy is
        the same function of (B, epochs, sigma) whichever model is chosen).
      score_noise_std: std, in counts, of the Gaussian noise added to the number of correct
        validation predictions (default 10: private by default). None = exact score, allowed only
        on a validation set declared public and separate from the private data.
    """

    learning_rate: float = 2.0
    clip_norm: float = 1.0
    noise_multiplier: float = 1.1
    batch_size: int = 256
    epochs: int = 5
    optimizer: str = "sgd"
    momentum: float = 0.9
    model: str = "cnn26k"
    score_noise_std: float | None = 10.0

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
        if self.model not in models.MODEL_NAMES:
            bad("model", f"must be one of {models.MODEL_NAMES}")
        if self.score_noise_std is not None and not (
            self.score_noise_std > 0 and math.isfinite(self.score_noise_std)
        ):
            bad("score_noise_std", "must be None (exact score) or a finite number > 0")


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


def dpsgd_privacy(hp: Hyperparams, num_train: int) -> DpSgdPrivacy:
    """The DP-SGD parameters of a candidate: the single source of truth.

    ``num_train`` must be PUBLIC: the dataset's nominal size (``Dataset.public_num_train``), never
    ``len()`` of the private arrays, whose length changes when one person is added or removed.
    q = B / N (Poisson sampling rate), steps = epochs * ceil(N / B), sigma = noise_multiplier.
    """
    if num_train < hp.batch_size:
        raise ValueError(
            f"num_train={num_train} is smaller than the expected batch size {hp.batch_size}"
        )
    return DpSgdPrivacy(
        sampling_rate=hp.batch_size / num_train,
        steps=hp.epochs * steps_per_epoch(hp.batch_size, num_train),
        noise_multiplier=float(hp.noise_multiplier),
    )


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
      error: the exception text if training raised, else None.
    """

    params: Any
    validation_score: float
    history: list[dict]
    failed: bool
    error: str | None = None


# --- optimisers -----------------------------------------------------------------------------------


def make_optimizer(hp: Hyperparams) -> optax.GradientTransformation:
    """optax optimiser with its numeric hyperparameters in the state (inject_hyperparams), so that
    candidates with different learning rates / momenta share one compiled step and can be
    vectorised."""
    if hp.optimizer == "sgd":
        return optax.inject_hyperparams(optax.sgd)(learning_rate=hp.learning_rate)
    if hp.optimizer == "momentum":
        return optax.inject_hyperparams(optax.sgd)(
            learning_rate=hp.learning_rate, momentum=hp.momentum
        )
    return optax.inject_hyperparams(optax.adam)(learning_rate=hp.learning_rate)


# --- compiled steps -------------------------------------------------------------------------------


def default_grad_impl(model: str, image_shape: tuple[int, ...]) -> str:
    """ "bookkeeping" for the 28x28x1 MnistCNN family and for scatter_linear (the fast paths),
    "naive" (vmap(grad)) otherwise."""
    if model in ("cnn26k", "cnn52k") and tuple(image_shape) == (28, 28, 1):
        return "bookkeeping"
    if model == "scatter_linear":  # closed-form norms (dpsgd.clipped_sum_scatter_linear)
        return "bookkeeping"
    return "naive"


class StepFunctions:
    """Jitted DP-SGD functions for one (model, optimiser kind, gradient implementation).

    A step compiles once per chunk shape: ``accumulate`` for the tail chunks (if any) and the fused
    ``step`` for the main chunk, which adds the running sums, the noise and the optimiser update.
    The ``v*`` variants are the same functions vmapped over K candidates. ``trace_count`` counts
    Python traces (a test checks that training does not retrace).
    """

    def __init__(self, model: str, num_classes: int, optimizer: str, grad_impl: str):
        tune_malloc()  # keeps the step's large temporaries mapped between steps (see runtime.py)
        self.spec = models.get_model(model, num_classes)
        self.grad_impl = grad_impl
        # Only the update rule matters here; numeric hyperparameters live in the optimiser state.
        self.optimizer = make_optimizer(Hyperparams(optimizer=optimizer, model=model))
        self.trace_count = 0
        apply_fn = self.spec.module.apply
        if grad_impl == "bookkeeping" and model == "scatter_linear":
            self._clipped_sum = dpsgd.clipped_sum_scatter_linear
        elif grad_impl == "bookkeeping":
            self._clipped_sum = dpsgd.clipped_sum_bookkeeping
        elif grad_impl == "naive":
            self._clipped_sum = functools.partial(dpsgd.clipped_sum_naive, apply_fn)
        else:
            raise ValueError(f"grad_impl={grad_impl!r}: expected 'bookkeeping' or 'naive'")

        self.chunk_sum = jax.jit(self._chunk_sum)
        self.accumulate = jax.jit(self._accumulate)
        self.step = jax.jit(self._step)
        self.vaccumulate = jax.jit(
            jax.vmap(self._accumulate, in_axes=(0, 0, 0, None, None, 0, 0, 0))
        )
        self.vstep = jax.jit(
            jax.vmap(self._step, in_axes=(0, 0, 0, 0, None, None, 0, 0, 0, None, 0, 0, None))
        )

    def _chunk_sum(self, params, data_x, data_y, idx, mask, clip_norm):
        """Clipped gradient sum and loss sum over one chunk (idx, mask) of a batch."""
        self.trace_count += 1
        gsum, loss, _ = self._clipped_sum(params, data_x[idx], data_y[idx], mask, clip_norm)
        return gsum, loss

    def _accumulate(self, params, gsum, loss, data_x, data_y, idx, mask, clip_norm):
        """Running totals plus one more chunk's clipped gradient sum and loss sum."""
        g, lo = self._chunk_sum(params, data_x, data_y, idx, mask, clip_norm)
        return jax.tree_util.tree_map(jnp.add, gsum, g), loss + lo

    def _step(
        self, params, opt_state, gsum, loss, data_x, data_y, idx, mask, key, step, clip_norm,
        sigma, expected_batch,
    ):  # fmt: skip
        """One DP-SGD step: clipped sum of the main chunk plus the running totals of the tail chunks
        (zeros if none), Gaussian noise keyed by (candidate key, step), division by the expected
        batch size, optimiser update. Returns (params, opt_state, loss sum of the batch)."""
        gsum, loss = self._accumulate(params, gsum, loss, data_x, data_y, idx, mask, clip_norm)
        noisy = dpsgd.add_noise(gsum, jax.random.fold_in(key, step), sigma, clip_norm)
        grads = jax.tree_util.tree_map(lambda g: g / expected_batch, noisy)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss


@functools.lru_cache(maxsize=32)
def get_step_functions(
    model: str, num_classes: int, optimizer: str, grad_impl: str
) -> StepFunctions:
    """Cached :class:`StepFunctions`, so that every candidate with the same structure reuses the
    compiled step."""
    return StepFunctions(model, num_classes, optimizer, grad_impl)


# --- data on device, evaluation -------------------------------------------------------------------

_DEVICE_DATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FEATURE_DATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_data(data: Dataset, model: str) -> Dataset:
    """The dataset as ``model`` reads it: ``data`` itself, or for the scatter models a Dataset
    whose three splits hold the images' scattering features (n, 7, 7, 81) (``trainers.scatter``,
    cached on disk per record; computed once per Dataset object in this process). The records,
    labels and every other field stay the same, so sampling rates and privacy are unchanged."""
    spec = models.get_model(model, data.num_classes)
    if spec.features is None:
        return data
    cached = _FEATURE_DATA.get(data)
    if cached is None:
        from trainers import scatter

        n_tr, n_va = len(data.train_x), len(data.val_x)
        feats = scatter.features(np.concatenate([data.train_x, data.val_x, data.test_x]))
        cached = dataclasses.replace(
            data,
            train_x=feats[:n_tr],
            val_x=feats[n_tr : n_tr + n_va],
            test_x=feats[n_tr + n_va :],
        )
        _FEATURE_DATA[data] = cached
    return cached


_INPUTS: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def _inputs_for(model, x: np.ndarray) -> np.ndarray:
    """``x`` as ``model`` reads it: images become scattering features for the scatter models
    (memoised per array object, so per-epoch test evaluations do not rehash the test set)."""
    module = _module_of(model)
    if not isinstance(module, (models.ScatterLinear, models.ScatterCNN)):
        return x
    if tuple(x.shape[1:]) == models.SCATTER_SHAPE:
        return x
    hit = _INPUTS.get(id(x))
    if hit is not None and hit[0]() is x:
        return hit[1]
    from trainers import scatter

    feats = scatter.features(x)
    try:
        _INPUTS[id(x)] = (weakref.ref(x), feats)
        weakref.finalize(x, _INPUTS.pop, id(x), None)
    except TypeError:  # an array view that cannot be weakly referenced: just not memoised
        pass
    return feats


def device_arrays(data: Dataset) -> tuple[jax.Array, jax.Array]:
    """Training arrays placed on the default device once per Dataset object."""
    arrays = _DEVICE_DATA.get(data)
    if arrays is None:
        arrays = (jax.device_put(data.train_x), jax.device_put(data.train_y))
        _DEVICE_DATA[data] = arrays
    return arrays


_EVAL_BATCH = 1000


@functools.lru_cache(maxsize=32)
def _count_correct_fn(module: nn.Module):
    @jax.jit
    def count(params, x, y, mask):
        logits = module.apply({"params": params}, x)
        return jnp.sum(mask * (jnp.argmax(logits, axis=-1) == y))

    return count


def count_correct(params, model, x: np.ndarray, y: np.ndarray) -> int:
    """Number of examples whose arg-max logit equals the label; fixed-size batches so nothing
    recompiles."""
    module = _module_of(model)
    fn = _count_correct_fn(module)
    x = _inputs_for(module, x)
    total = 0
    for start in range(0, len(x), _EVAL_BATCH):
        xb, yb = x[start : start + _EVAL_BATCH], y[start : start + _EVAL_BATCH]
        n = len(xb)
        mask = np.zeros(_EVAL_BATCH, np.float32)
        mask[:n] = 1
        if n < _EVAL_BATCH:
            xb = np.concatenate([xb, np.zeros((_EVAL_BATCH - n, *xb.shape[1:]), xb.dtype)])
            yb = np.concatenate([yb, np.zeros(_EVAL_BATCH - n, yb.dtype)])
        total += int(fn(params, xb, yb, mask))
    return total


def evaluate(params, model, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy in [0, 1] of ``params`` on (x, y). ``model``: a model name, a ModelSpec or a flax
    Module."""
    if len(x) == 0:
        raise ValueError("evaluate() needs at least one example")
    return count_correct(params, model, x, y) / len(x)


def _module_of(model) -> nn.Module:
    if isinstance(model, str):
        return models.get_model(model).module
    if isinstance(model, models.ModelSpec):
        return model.module
    if isinstance(model, nn.Module):
        return model
    raise TypeError(f"model={model!r}: expected a model name, a ModelSpec or a flax Module")


# --- training -------------------------------------------------------------------------------------


def _as_key(key) -> jax.Array:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    if key.dtype != jnp.uint32 or key.shape != (2,):
        raise ValueError(
            f"key must be a jax PRNG key (typed or uint32[2]); got {key.dtype}{key.shape}"
        )
    return key


def _numpy_rng(key: jax.Array) -> np.random.Generator:
    """numpy Generator for Poisson sampling, seeded by the (secret) candidate key."""
    return np.random.Generator(np.random.PCG64(np.asarray(key).tolist()))


def _all_finite(tree) -> bool:
    return bool(
        jax.tree_util.tree_reduce(
            lambda a, b: a & b, jax.tree_util.tree_map(lambda p: jnp.all(jnp.isfinite(p)), tree)
        )
    )


def _check(hp: Hyperparams, data: Dataset) -> None:
    spec = models.get_model(hp.model, data.num_classes)
    if spec.features == "scatter":
        from trainers import scatter

        scatter.kymatio_version()  # raises KymatioMissingError with how to install it
        if tuple(data.train_x.shape[1:]) != (*scatter.IMAGE_HW, 1):
            raise ValueError(
                f"model {hp.model!r} computes scattering features of 28x28x1 images, but dataset "
                f"{data.name!r} has {tuple(data.train_x.shape[1:])}"
            )
    elif tuple(data.train_x.shape[1:]) != spec.input_shape:
        raise ValueError(
            f"model {hp.model!r} expects images of shape {spec.input_shape}, but dataset "
            f"{data.name!r} has "
            f"{tuple(data.train_x.shape[1:])}"
        )
    dpsgd_privacy(hp, data.public_num_train)  # raises if N < B
    if len(data.val_x) == 0 or data.public_num_val <= 0:
        raise ValueError(
            "the dataset has no validation examples (validation_size=0): nothing to score"
        )
    if hp.score_noise_std is None and not data.validation_public:
        raise ValueError(
            "score_noise_std=None scores candidates exactly, but this dataset's validation split "
            "is private (cut from the private training file): set score_noise_std > 0, or supply "
            "a separate validation set declared public (load_dataset(validation_dir=..., "
            "validation_public=True))"
        )


def _score(hp: Hyperparams, params, data: Dataset, key: jax.Array) -> float:
    """Validation accuracy. With score_noise_std: (correct + N(0, std^2)) / public_num_val, the
    Gaussian mechanism on a count of sensitivity 1, divided by a public constant (the expected
    validation size), never by the private split's length. Exact (public validation set only):
    correct / len(val)."""
    correct = count_correct(params, hp.model, data.val_x, data.val_y)
    if hp.score_noise_std is None:
        return float(correct) / len(data.val_x)
    correct = correct + hp.score_noise_std * float(jax.random.normal(key, (), jnp.float32))
    return float(correct) / float(data.public_num_val)


def train_candidate(
    hp: Hyperparams,
    data: Dataset,
    key,
    *,
    progress: Progress | None = None,
    progress_every: int = 0,
    grad_impl: str | None = None,
    on_epoch: Callable[[int, int, Any], None] | None = None,
) -> CandidateResult:
    """Trains one DP-SGD candidate and scores it on the validation split. Never raises once inputs
    are valid.

    Args:
      hp: hyperparameters.
      data: the dataset (training split private; validation split private unless
        ``hp.score_noise_std`` is None).
      key: the candidate's secret PRNG key (initialisation, Poisson sampling, gradient noise, score
        noise).
      progress: called after every epoch with {"event": "epoch", "candidate": 0, "epoch", "epochs",
        "step", "total_steps"} and, if ``progress_every`` > 0, every ``progress_every`` steps with
        event "step". The dicts hold no data-dependent values, so a progress bar can show them.
      grad_impl: "bookkeeping" or "naive"; default :func:`default_grad_impl`.
      on_epoch: called as on_epoch(candidate, epoch, params) after every epoch. The parameters are
        private (curator-only); meant for research scripts that plot test-accuracy curves.

    Raises:
      ValueError: inconsistent inputs (model vs image shape, N < B, no validation data, bad key).
    """
    return train_candidates(
        [hp], data, [key], progress=progress, progress_every=progress_every, grad_impl=grad_impl,
        vectorize=False, on_epoch=on_epoch,
    )[0]  # fmt: skip


def train_candidates(
    hps: Sequence[Hyperparams],
    data: Dataset,
    keys: Sequence,
    *,
    progress: Progress | None = None,
    progress_every: int = 0,
    vectorize: bool | None = None,
    grad_impl: str | None = None,
    on_epoch: Callable[[int, int, Any], None] | None = None,
) -> list[CandidateResult]:
    """Trains K candidates; results in the order of ``hps``.

    ``vectorize=None`` (auto) trains structurally identical candidates (same model, optimiser, batch
    size, epochs) together with ``vmap`` on accelerators and one after another on CPU, where vmap
    was measured slower (``docs/performance.md``). Each candidate keeps its own key, so results do
    not depend on the grouping (up to float rounding). Progress dicts carry the candidate's index in
    "candidate".
    """
    hps = list(hps)
    keys = [_as_key(k) for k in keys]
    if len(hps) != len(keys):
        raise ValueError(f"got {len(hps)} hyperparameter sets but {len(keys)} keys")
    for hp in hps:
        _check(hp, data)
    if vectorize is None:
        vectorize = jax.default_backend() != "cpu"
    results: list[CandidateResult | None] = [None] * len(hps)
    groups: dict[tuple, list[int]] = {}
    for i, hp in enumerate(hps):
        sig = (hp.model, hp.optimizer, hp.batch_size, hp.epochs)
        groups.setdefault(sig if vectorize else (i,), []).append(i)
    for members in groups.values():
        impl = grad_impl or default_grad_impl(hps[members[0]].model, data.train_x.shape[1:])
        gdata = model_data(data, hps[members[0]].model)  # scattering features for scatter models
        group = _train_group(
            [hps[i] for i in members], gdata, [keys[i] for i in members], members, progress,
            progress_every, impl, on_epoch,
        )  # fmt: skip
        for i, r in zip(members, group, strict=True):
            results[i] = r
    return results  # type: ignore[return-value]


def _train_group(
    hps, data, keys, indices, progress, progress_every, impl, on_epoch
) -> list[CandidateResult]:
    try:
        return _train_group_unsafe(
            hps, data, keys, indices, progress, progress_every, impl, on_epoch
        )
    except Exception as e:  # a candidate must never abort the search (OOM, XLA errors, ...)
        if len(hps) > 1:  # retry one by one so that one bad candidate does not fail its group
            return [
                _train_group([hp], data, [k], [i], progress, progress_every, impl, on_epoch)[0]
                for hp, k, i in zip(hps, keys, indices, strict=True)
            ]
        log.warning("candidate %d failed with %s", indices[0], type(e).__name__)
        return [CandidateResult(None, FAILURE_SCORE, [], True, f"{type(e).__name__}: {e}")]


def _train_group_unsafe(hps, data, keys, indices, progress, progress_every, impl, on_epoch):
    hp0 = hps[0]
    k = len(hps)
    vectorized = k > 1
    fns = get_step_functions(hp0.model, data.num_classes, hp0.optimizer, impl)
    data_x, data_y = device_arrays(data)
    # Privacy parameters from the PUBLIC nominal size: q = B / N_public and the step count; the
    # sampler then includes each of the actual records with probability q (Poisson sampling does
    # not need the actual size to be public, the accountant's q does).
    plan = dpsgd_privacy(hp0, data.public_num_train)
    n_train = len(data.train_x)
    spe = steps_per_epoch(hp0.batch_size, data.public_num_train)
    total_steps = plan.steps

    subkeys = [jax.random.split(key, 4) for key in keys]  # init, sampling, noise, score
    params = [models.init_params(fns.spec, sk[0]) for sk in subkeys]
    opt_states = [make_optimizer(hp).init(p) for hp, p in zip(hps, params, strict=True)]
    samplers = [
        PoissonSampler(n_train, hp0.batch_size, _numpy_rng(sk[1]), sampling_rate=plan.sampling_rate)
        for sk in subkeys
    ]
    noise_keys = [sk[2] for sk in subkeys]
    clip = [jnp.float32(hp.clip_norm) for hp in hps]
    sigma = [jnp.float32(hp.noise_multiplier) for hp in hps]
    expected_b = jnp.float32(hp0.batch_size)
    if vectorized:
        stack = lambda xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
        params, opt_states = stack(params), stack(opt_states)
        noise_keys, clip, sigma = jnp.stack(noise_keys), jnp.stack(clip), jnp.stack(sigma)
    else:
        params, opt_states = params[0], opt_states[0]
        noise_keys, clip, sigma = noise_keys[0], clip[0], sigma[0]

    zero_sum = jax.tree_util.tree_map(jnp.zeros_like, params)
    zero_loss = jnp.zeros((k,) if vectorized else (), jnp.float32)
    histories: list[list[dict]] = [[] for _ in hps]
    failed = [False] * k
    last_good = params
    step = 0
    for epoch in range(hp0.epochs):
        t0 = time.perf_counter()
        loss_sum = jnp.zeros((k,) if vectorized else ())
        n_seen = np.zeros(k)
        for _ in range(spe):
            batches = [s.sample() for s in samplers]
            chunked = [s.chunks(b) for s, b in zip(samplers, batches, strict=True)]
            n_seen += [len(b) for b in batches]
            n_chunks = max(len(c) for c in chunked)
            step_arr = jnp.int32(step)
            # Chunks after the first go through `accumulate` (further body chunks when B > 256; a
            # tail chunk in ~half the steps, when the Poisson batch outgrows the body), then the
            # fused step on the first chunk adds their sums, the noise and the optimiser update.
            gsum, loss = zero_sum, zero_loss
            acc_fn = fns.vaccumulate if vectorized else fns.accumulate
            for j in range(1, n_chunks):
                idx, mask = _stack_chunk(chunked, j, vectorized)
                gsum, loss = acc_fn(params, gsum, loss, data_x, data_y, idx, mask, clip)
            idx, mask = _stack_chunk(chunked, 0, vectorized)
            step_fn = fns.vstep if vectorized else fns.step
            params, opt_states, loss = step_fn(
                params, opt_states, gsum, loss, data_x, data_y, idx, mask, noise_keys, step_arr,
                clip, sigma, expected_b,
            )  # fmt: skip
            loss_sum = loss_sum + loss
            step += 1
            if progress is not None and progress_every > 0 and step % progress_every == 0:
                for i in indices:
                    progress(_progress_dict("step", i, epoch, hp0.epochs, step, total_steps))
        # Failure is decided from the parameters alone (post-processing of the DP output), never
        # from the loss.
        finite = _finite_per_candidate(params, vectorized, k)
        losses = np.atleast_1d(np.asarray(loss_sum, dtype=np.float64)) / np.maximum(n_seen, 1)
        seconds = time.perf_counter() - t0
        for c in range(k):
            if failed[c]:
                continue
            if not finite[c]:
                failed[c] = True
                continue
            histories[c].append(
                {
                    "epoch": epoch + 1,
                    "steps": step,
                    "train_loss": float(losses[c]),
                    "seconds": seconds,
                }
            )
        if all(failed):
            break
        last_good = _keep_finite(last_good, params, finite, vectorized)
        if on_epoch is not None:
            for c, i in enumerate(indices):
                if not failed[c]:
                    p = (
                        jax.tree_util.tree_map(lambda a, c=c: a[c], params)
                        if vectorized
                        else params
                    )
                    on_epoch(i, epoch + 1, p)
        if progress is not None:
            for i in indices:
                progress(_progress_dict("epoch", i, epoch, hp0.epochs, step, total_steps))

    results = []
    for c, hp in enumerate(hps):
        p = jax.tree_util.tree_map(lambda a, c=c: a[c], last_good) if vectorized else last_good
        p = jax.tree_util.tree_map(np.asarray, p)
        if failed[c]:
            results.append(CandidateResult(p, FAILURE_SCORE, histories[c], True))
        else:
            score = _score(hp, p, data, subkeys[c][3])
            results.append(CandidateResult(p, score, histories[c], False))
    return results


def _progress_dict(event, candidate, epoch, epochs, step, total_steps) -> dict:
    # Only public quantities (counts fixed by the hyperparameters): safe to show in a progress bar.
    return {
        "event": event,
        "candidate": candidate,
        "epoch": epoch + 1,
        "epochs": epochs,
        "step": step,
        "total_steps": total_steps,
    }


def _stack_chunk(chunked, j, vectorized):
    """The j-th (idx, mask) chunk of every candidate; an all-masked chunk for candidates with fewer
    chunks."""
    size = next(len(c[j][0]) for c in chunked if j < len(c))
    parts = []
    for chunks in chunked:
        if j < len(chunks):
            parts.append(chunks[j])
        else:
            parts.append((np.zeros(size, np.int32), np.zeros(size, np.float32)))
    if not vectorized:
        return parts[0]
    return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])


def _finite_per_candidate(params, vectorized, k) -> list[bool]:
    if not vectorized:
        return [_all_finite(params)]
    leaves = jax.tree_util.tree_leaves(params)
    ok = jnp.ones((k,), bool)
    for leaf in leaves:
        ok = ok & jnp.all(jnp.isfinite(leaf.reshape(k, -1)), axis=1)
    return [bool(v) for v in np.asarray(ok)]


def _keep_finite(last_good, params, finite, vectorized):
    if not vectorized:
        return params if finite[0] else last_good
    sel = jnp.asarray(finite)
    return jax.tree_util.tree_map(
        lambda new, old: jnp.where(sel.reshape((-1,) + (1,) * (new.ndim - 1)), new, old),
        params,
        last_good,
    )
