"""The compiled DP-SGD step: optimisers (optax, with an optional parameter average) and the jitted
per-example-clipped, noised update for one candidate or K candidates at once.

One DP-SGD step (Abadi et al. 2016, Algorithm 1, with Poisson sampling as the accountant assumes):
  1. draw a Poisson batch (each of the N training examples independently with probability
     q = B / N) -- done by ``trainers.sampling`` outside the step;
  2. clip every per-example gradient to L2 norm C and sum (``trainers.dpsgd``);
  3. add Gaussian noise N(0, (sigma C)^2 I);
  4. divide by the *expected* batch size B (not the realised one, which would leak the batch size)
     and hand the result to an optax optimiser.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainers import dpsgd, finetune, ghost, lora, models, parallel, train_mode
from trainers.runtime import tune_malloc
from trainers.spec import Hyperparams


def make_optimizer(hp: Hyperparams) -> optax.GradientTransformation:
    """optax optimiser with its numeric hyperparameters in the state (inject_hyperparams), so that
    candidates with different learning rates / momenta share one compiled step and can be
    vectorised. With ``hp.ema_decay`` the state also carries the parameter average
    (:func:`with_param_ema`)."""
    # Python floats: optax injects them into the state (NumPy scalars it would keep static). The
    # state holds float32, so float(np.float32(x)) stores exactly what x would.
    return _optimizer(hp.optimizer, **{k: float(v) for k, v in optimizer_numbers(hp).items()})


def optimizer_numbers(hp: Hyperparams) -> dict[str, np.float32]:
    """The numeric hyperparameters ``make_optimizer(hp)`` puts in the optimiser state, as float32
    scalars (what the state holds): ``learning_rate``, ``momentum`` for "momentum", ``ema_decay``
    with a parameter average. Which keys appear depends only on the optimiser kind and whether
    there is an average, so one compiled :meth:`StepFunctions.init_opt` serves every candidate."""
    numbers = {"learning_rate": np.float32(hp.learning_rate)}
    if hp.optimizer == "momentum":
        numbers["momentum"] = np.float32(hp.momentum)
    if hp.ema_decay is not None:
        numbers["ema_decay"] = np.float32(hp.ema_decay)
    return numbers


def _optimizer(kind: str, learning_rate, momentum=None, ema_decay=None):
    # The numbers are Python floats or arrays (tracers, in a compiled init); optax injects both
    # into the state as float32 arrays (a NumPy scalar it would treat as a static argument).
    if kind == "sgd":
        opt = optax.inject_hyperparams(optax.sgd)(learning_rate=learning_rate)
    elif kind == "momentum":
        opt = optax.inject_hyperparams(optax.sgd)(learning_rate=learning_rate, momentum=momentum)
    else:
        opt = optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate)
    if ema_decay is not None:
        opt = with_param_ema(opt, ema_decay)
    return opt


class ParamEmaState(NamedTuple):
    """State of :func:`with_param_ema`: the wrapped optimiser's state, the parameter average, the
    step count and the decay (in the state, so candidates with different decays share a step)."""

    inner: Any
    ema: Any
    count: jax.Array
    decay: jax.Array


def with_param_ema(inner: optax.GradientTransformation, decay: float):
    """Wraps an optimiser so that its state tracks an exponential moving average of the parameters
    after each update: ema_t = d_t ema_{t-1} + (1 - d_t) params_t, d_t = min(decay, (1+t)/(10+t))
    (the warm-up of tf.train.ExponentialMovingAverage with num_updates; De et al. 2022 average the
    parameters in the same way). optax's own ``ema`` averages updates, not parameters."""

    def init(params):
        return ParamEmaState(
            inner.init(params),
            jax.tree_util.tree_map(jnp.asarray, params),
            jnp.zeros([], jnp.int32),
            jnp.float32(decay),
        )

    def update(updates, state, params):
        updates, inner_state = inner.update(updates, state.inner, params)
        new_params = optax.apply_updates(params, updates)
        t = state.count + 1
        tf = t.astype(jnp.float32)
        d = jnp.minimum(state.decay, (1.0 + tf) / (10.0 + tf))
        ema = jax.tree_util.tree_map(lambda e, p: d * e + (1.0 - d) * p, state.ema, new_params)
        return updates, ParamEmaState(inner_state, ema, t, state.decay)

    return optax.GradientTransformation(init, update)


# --- compiled steps -------------------------------------------------------------------------------


#: Spellings of ``grad_impl``: "auto" (the fastest correct path), "vmap" (``vmap(grad)``, any
#: model; "naive" is the old name), "ghost" (the generic ghost / book-keeping path of
#: ``trainers.ghost`` for modules built from known layers), "bookkeeping" (a shipped model's
#: hand-tuned path).
GRAD_IMPLS = ("auto", "vmap", "ghost", "bookkeeping", "naive")

log = logging.getLogger(__name__)


def default_grad_impl(model: Any, image_shape: tuple[int, ...], augmult: int = 0) -> str:
    """ "bookkeeping" (the hand-tuned fast path) for the 28x28x1 MnistCNN family without
    augmentation and for the CIFAR CNN (with or without augmentation multiplicity) and for
    scatter_linear (closed-form norms, ``dpsgd.clipped_sum_scatter_linear``); "ghost" (the generic
    path of ``trainers.ghost``) for WRN-16-4 on 32x32x3 images, with or without augmentation
    (its weight-standardised convolutions declare themselves reparametrised ``nn.Conv`` layers,
    its group norms are known layers); "naive" (vmap(grad)) for the other shipped models. A
    user's model: "ghost" when :func:`ghost_plan` accepts it, else "vmap"."""
    if isinstance(model, models.ModelSpec) and not model.shipped:
        return "ghost" if ghost_plan(model).supported else "vmap"
    model = models.resolve(model).name
    shape = tuple(image_shape)
    if model in ("cnn26k", "cnn52k") and shape == (28, 28, 1) and augmult == 0:
        return "bookkeeping"
    if model == "scatter_linear" and augmult == 0:
        return "bookkeeping"
    if model == "cifar_cnn" and shape == (32, 32, 3):
        return "bookkeeping"
    if model == "wrn16_4" and shape == (32, 32, 3):
        # The plan's probes still decide (cached): where they refuse, vmap(grad) is correct.
        return "ghost" if ghost_plan(models.resolve(model)).supported else "naive"
    return "naive"


@functools.lru_cache(maxsize=64)
def ghost_plan(spec: models.ModelSpec) -> Any:
    """``trainers.ghost.analyze`` of a spec's module (cached per spec object). A module that
    cannot take the ghost path is logged once, with the reason."""
    if spec.module is None:
        plan = ghost.GhostPlan("an (init_fn, apply_fn) pair has no layers to intercept")
    else:
        params = jax.eval_shape(lambda: models.init_params(spec, jax.random.PRNGKey(0)))
        params = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), params)
        x = jax.ShapeDtypeStruct((3, *spec.input_shape), spec.input_dtype)
        y = jax.ShapeDtypeStruct((3, *spec.label_shape), spec.label_dtype)
        mask = None if finetune.all_trainable(spec.trainable) else spec.trainable
        # The spec applies the module as training does (a dict input unpacked; a module with a
        # train keyword in training mode, dropout on with a fixed key: the row probes compare
        # batches drawn with the same masks).
        module = spec.training(jax.random.PRNGKey(0)) if spec.stochastic else spec
        plan = ghost.analyze(
            module, params, x, spec.loss or dpsgd.per_example_loss, y, trainable=mask
        )
        if plan.supported and isinstance(spec.module, lora.LoRA):
            plan = _lora_plan(spec.module, mask, x) or plan
    if not plan.supported:
        log.warning(
            "model %s: per-example clipping by vmap(grad) (correct for any model, slower): the "
            "ghost path does not apply because %s",
            spec.name,
            plan.reason,
        )
    return plan


def _lora_plan(module: lora.LoRA, mask: Any, x: Any) -> ghost.GhostPlan | None:
    """A refusal when a LoRA-adapted layer itself trains: the ghost path records a trainable
    layer on its own copy of the parameters, which would drop the adapter added around it."""
    flat = {} if mask is None else finetune.flat_paths(mask)
    for layer in lora.targeted_layers(module, x):
        if mask is None or any(v for p, v in flat.items() if p.startswith(layer + "/")):
            return ghost.GhostPlan(f"the LoRA-adapted layer {layer} is trainable")
    return None


def resolve_grad_impl(model: Any, grad_impl: str | None, image_shape, augmult: int = 0) -> str:
    """The implementation a step will use: "bookkeeping", "ghost" or "vmap" (``grad_impl`` None
    or "auto": :func:`default_grad_impl`). Raises ValueError for an unknown spelling, or "ghost"
    forced on a module the ghost path does not cover (with the reason)."""
    impl = "auto" if grad_impl is None else grad_impl
    if impl not in GRAD_IMPLS:
        raise ValueError(f"grad_impl={grad_impl!r}: expected one of {GRAD_IMPLS}")
    forced = impl != "auto"
    if impl == "auto":
        impl = default_grad_impl(model, image_shape, augmult)
    if impl == "naive":
        return "vmap"
    if impl == "ghost":
        spec = models.resolve(model)
        plan = ghost_plan(spec)  # logs the reason once when the plan is refused
        if not plan.supported:
            if not forced:  # a default, not the user's word: the generic path is always correct
                return "vmap"
            raise ValueError(
                f"grad_impl='ghost' does not apply to model {spec.name}: {plan.reason}"
            )
    return impl


# Images (examples x augmented copies) per compiled chunk, by model. cnn26k: 256 was the fastest
# chunk on XLA CPU (docs/performance.md). CIFAR models: bounded so that one chunk of the step fits
# in well under 16 GB (peak memory measured by scripts/memory_dpsgd.py, docs/performance.md).
_CHUNK_IMAGES = {"cnn26k": 256, "cnn52k": 256, "cifar_cnn": 256, "wrn16_4": 256}

#: vmap(grad) materialises one gradient per example: a user model's chunk holds at most this many
#: gradient floats (256 MiB in float32), whatever the expected batch size.
VMAP_CHUNK_FLOATS = 2**26


def default_microbatch_size(model: Any, augmult: int = 0, grad_impl: str | None = None) -> int:
    """Examples per compiled chunk when ``Hyperparams.microbatch_size`` is None: the model's image
    budget divided by the augmentation multiplicity, rounded down to a multiple of 8, at least 8.
    A user's model on the vmap path: also at most ``VMAP_CHUNK_FLOATS`` / (parameters x copies)
    examples, so that memory stays bounded."""
    name = model if isinstance(model, str) else model.name
    per_chunk = _CHUNK_IMAGES.get(name, 256) // max(1, augmult)
    if isinstance(model, models.ModelSpec) and not model.shipped and grad_impl in ("vmap", "naive"):
        shapes = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
        per_chunk = min(per_chunk, VMAP_CHUNK_FLOATS // max(1, models.param_count(shapes)))
    return max(8, per_chunk // 8 * 8)


# Which arguments of ``_accumulate`` / ``_step`` are per candidate (0: a leading candidate axis) and
# which are shared by the group (None: the training arrays, the step and chunk counters, B).
_ACCUMULATE_AXES = (0, 0, 0, None, None, 0, 0, 0, 0, None, None)
_STEP_AXES = (0, 0, 0, 0, None, None, 0, 0, 0, None, 0, 0, None)


@dataclasses.dataclass(frozen=True)
class Group:
    """The compiled functions for a group of ``k`` >= 1 structurally identical candidates, and the
    layout of their per-candidate values (parameters, optimiser states, running sums, losses,
    chunks, keys, clip norms, noise multipliers).

    K > 1: every per-candidate value carries a leading candidate axis of size K and the functions
    are the vmapped step (``StepFunctions.vaccumulate`` / ``vstep``). K = 1: the candidate's values
    as they are and the plain jitted step (``accumulate`` / ``step``), the path measured fastest on
    CPU (docs/performance.md, "Before and after the trainers split"). The training loop goes
    through these methods only, so it has one code path for every K.
    """

    k: int
    accumulate: Any
    step: Any
    #: ``StepFunctions.run_chunk`` / ``run_step`` (K = 1) or ``vrun_chunk`` / ``vrun_step``
    #: (K > 1): a chunk, and the step, of an epoch whose batches are already on the device.
    run_chunk: Any = None
    run: Any = None

    def stack(self, trees: list) -> Any:
        """K per-candidate pytrees (or scalars) in this group's layout, on the device. Host values
        (NumPy arrays and scalars) are stacked on the host and copied once; device arrays in one
        compiled program per tree structure (an eager ``jnp.stack`` would compile a program per
        leaf shape, each costing a trace and a cache lookup even on a warm start)."""
        if len(trees) != self.k:
            raise ValueError(f"expected {self.k} per-candidate values, got {len(trees)}")
        if self.k == 1:
            return jax.device_put(trees[0])
        if any(isinstance(a, jax.Array) for a in jax.tree_util.tree_leaves(trees)):
            return _stack_trees(trees)
        return jax.device_put(jax.tree_util.tree_map(lambda *a: np.stack(a), *trees))

    def row(self, tree: Any, c: int) -> Any:
        """Candidate c's values of a pytree in this group's layout (one compiled program for
        every c)."""
        return tree if self.k == 1 else _take_row(tree, np.int32(c))

    def chunk(self, chunked: list, j: int) -> tuple[np.ndarray, np.ndarray]:
        """The j-th (idx, mask) chunk of every candidate (``chunked[c]``: candidate c's chunks) in
        this group's layout; an all-masked chunk for candidates with fewer chunks."""
        if self.k == 1:
            return chunked[0][j]
        size = next(len(c[j][0]) for c in chunked if j < len(c))
        empty = (np.zeros(size, np.int32), np.zeros(size, np.float32))
        parts = [chunks[j] if j < len(chunks) else empty for chunks in chunked]
        return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])

    def finite(self, tree: Any) -> list[bool]:
        """Whether each candidate's values in ``tree`` are all finite (one compiled program)."""
        return [bool(v) for v in np.asarray(_finite_rows(tree, self.k))]

    def keep_finite(self, last_good: Any, new: Any, finite: list[bool]) -> Any:
        """Each candidate's ``new`` values where ``finite``, its ``last_good`` ones otherwise."""
        if self.k == 1:
            return new if finite[0] else last_good
        return _select_rows(np.asarray(finite), new, last_good)


@jax.jit
def _stack_trees(trees: list) -> Any:
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)


@jax.jit
def _take_row(tree: Any, c: jax.Array) -> Any:
    return jax.tree_util.tree_map(lambda a: a[c], tree)


@functools.partial(jax.jit, static_argnums=1)
def _finite_rows(tree: Any, k: int) -> jax.Array:
    ok = jnp.ones((k,), bool)
    for leaf in jax.tree_util.tree_leaves(tree):
        ok = ok & jnp.all(jnp.isfinite(jnp.reshape(leaf, (k, -1))), axis=1)
    return ok


@jax.jit
def _select_rows(sel: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda n, o: jnp.where(sel.reshape((-1,) + (1,) * (n.ndim - 1)), n, o), new, old
    )


class StepFunctions:
    """Jitted DP-SGD functions for one (model, optimiser kind, gradient implementation).

    A step compiles once per chunk shape: ``accumulate`` for the tail chunks (if any) and the fused
    ``step`` for the main chunk, which adds the running sums, the noise and the optimiser update.
    ``run_chunk`` / ``run_step`` are ``accumulate`` / ``step`` on a chunk of an epoch whose
    batches are already on the device: they take no host value. The ``v*`` variants are the same
    functions vmapped over K candidates; :meth:`group` gives the :class:`Group` the training loop
    uses for a group of any size. ``trace_count`` counts Python traces (a test checks that
    training does not retrace).
    """

    def __init__(
        self, model: Any, num_classes: int, optimizer: str, grad_impl: str, augmult: int = 0,
        ema: bool = False, mesh: Any = None,
    ):  # fmt: skip
        tune_malloc()  # keeps the step's large temporaries mapped between steps (see runtime.py)
        self.spec = models.resolve(model, num_classes)
        self.grad_impl = grad_impl
        self.augmult = int(augmult)
        # Only the update rule matters here; numeric hyperparameters live in the optimiser state.
        self.optimizer_kind = optimizer
        self.optimizer = make_optimizer(
            Hyperparams(optimizer=optimizer, ema_decay=0.5 if ema else None)
        )
        self.trace_count = 0
        model = self.spec.name if self.spec.shipped else None
        # A module called in training mode gets per-example dropout keys each chunk
        # (`_stochastic_sum`); its clipped sum is built per call, around that chunk's key.
        self._stochastic = self.spec.stochastic
        if self._stochastic and mesh is not None:
            raise ValueError(
                f"dptune: model {self.spec.name} draws per-example randomness while training "
                "(dropout: a linen `train` / `deterministic` keyword or NNX `nnx.Rngs`), which "
                "data-parallel training does not support yet: train on one device"
            )
        if grad_impl == "bookkeeping":
            if model == "scatter_linear" and self.augmult == 0:
                self._clipped_sum = dpsgd.clipped_sum_scatter_linear
            elif model in ("cnn26k", "cnn52k") and self.augmult == 0:
                self._clipped_sum = dpsgd.clipped_sum_bookkeeping
            elif model == "cifar_cnn":
                self._clipped_sum = dpsgd.clipped_sum_bookkeeping_cifar
            else:
                raise ValueError(
                    f"grad_impl='bookkeeping' is not implemented for model={self.spec.name!r} "
                    f"with augmult={augmult}; use 'vmap' (or 'ghost')"
                )
        elif grad_impl not in ("vmap", "naive", "ghost"):
            raise ValueError(f"grad_impl={grad_impl!r}: expected one of {GRAD_IMPLS[1:]}")
        elif grad_impl == "ghost" and self.spec.module is None:
            raise ValueError("grad_impl='ghost' needs a flax Module, not an (init, apply) pair")
        # Fine-tuning (trainers.finetune): only the trainable leaves are differentiated, clipped,
        # noised and updated; the optimiser keeps state for them alone (optax.masked).
        mask = self.spec.trainable
        self.trainable = None if finetune.all_trainable(mask) else mask
        if self.trainable is not None:
            if grad_impl == "bookkeeping":
                raise ValueError(
                    "grad_impl='bookkeeping' trains every parameter; a model with a trainable "
                    "part takes 'ghost' or 'vmap'"
                )
            self.optimizer = optax.masked(self.optimizer, self.trainable)
        if grad_impl != "bookkeeping":
            self._clipped_sum = self._clipped_sum_of(self.spec)
        self.mesh = mesh
        if mesh is not None:
            # Data-parallel (trainers.parallel): each chunk's examples are split over the mesh,
            # clipped where they are, and the clipped sums reduced; `_step` then adds the noise
            # once to the reduced sum, so its std is sigma * C whatever the device count.
            self._clipped_sum = parallel.sharded_clipped_sum(self._clipped_sum, mesh)

        self.init_opt = jax.jit(self._init_opt)
        self.chunk_sum = jax.jit(self._chunk_sum)
        self.accumulate = jax.jit(self._accumulate)
        self.step = jax.jit(self._step)
        self.vaccumulate = jax.jit(jax.vmap(self._accumulate, in_axes=_ACCUMULATE_AXES))
        self.vstep = jax.jit(jax.vmap(self._step, in_axes=_STEP_AXES))
        # The epoch-on-device path carries the dropped count with the loss (the `*_counted`
        # functions); the step-by-step functions above keep their signatures.
        self.run_chunk = jax.jit(
            functools.partial(self._run_chunk, self._accumulate_counted), static_argnums=0
        )
        self.run_step = jax.jit(functools.partial(self._run_step, self._step_counted))
        vaccumulate = jax.vmap(self._accumulate_counted, in_axes=_ACCUMULATE_AXES)
        self.vrun_chunk = jax.jit(functools.partial(self._run_chunk, vaccumulate), static_argnums=0)
        self.vrun_step = jax.jit(
            functools.partial(self._run_step, jax.vmap(self._step_counted, in_axes=_STEP_AXES))
        )

    def group(self, k: int) -> Group:
        """The :class:`Group` (compiled functions and value layout) for ``k`` >= 1 candidates."""
        if k < 1:
            raise ValueError(f"a group has at least one candidate, got k={k}")
        if k > 1 and self.mesh is not None:
            raise ValueError("data-parallel training (a mesh) takes one candidate at a time")
        if k == 1:
            return Group(1, self.accumulate, self.step, self.run_chunk, self.run_step)
        return Group(k, self.vaccumulate, self.vstep, self.vrun_chunk, self.vrun_step)

    def _init_opt(self, params, numbers: dict):
        """The optimiser state of a candidate at ``params``: ``make_optimizer(hp).init(params)``
        for ``numbers = optimizer_numbers(hp)``, compiled once for every candidate of this
        structure (the numbers are arguments, not constants; eagerly, optax's init compiles an
        operation per parameter shape)."""
        opt = _optimizer(self.optimizer_kind, **numbers)
        if self.trainable is not None:
            opt = optax.masked(opt, self.trainable)
        return opt.init(params)

    def _chunk_sum(self, params, data_x, data_y, idx, mask, clip_norm, key=None, step=0, chunk=0):
        """Clipped gradient sum and loss sum over one chunk (idx, mask) of a batch. With
        augmentation multiplicity K, the chunk's images are replaced by K augmented copies each,
        drawn from (key, step, chunk) on a stream separate from the noise's."""
        gsum, loss, _ = self._chunk_terms(
            params, data_x, data_y, idx, mask, clip_norm, key, step, chunk
        )
        return gsum, loss

    def _chunk_terms(self, params, data_x, data_y, idx, mask, clip_norm, key, step, chunk):
        """:meth:`_chunk_sum`'s clipped sum and loss sum, and the chunk's number of examples
        dropped from the sum (mask > 0, gradient norm not finite: ``dpsgd.count_dropped``), ()
        int32. The count is PRIVATE: for the curator's view only."""
        self.trace_count += 1
        x = data_x[idx]
        if self.augmult > 0:
            # fold_in(key, step) keys the noise; a distinct constant first keeps the augmentation
            # stream apart from it (the two could only meet at step 0x41554755, ~1.1e9 steps).
            aug = jax.random.fold_in(jax.random.fold_in(key, 0x41554755), step)
            x = dpsgd.augment_copies(jax.random.fold_in(aug, chunk), x, self.augmult)
        if self._stochastic:
            clipped_sum = self._stochastic_sum(train_mode.dropout_key(key, step, chunk))
        else:
            clipped_sum = self._clipped_sum
        gsum, loss, norms = clipped_sum(params, x, data_y[idx], mask, clip_norm)
        return gsum, loss, dpsgd.count_dropped(norms, mask)

    def _stochastic_sum(self, rng: jax.Array) -> Callable:
        """The clipped-sum function of a module in training mode with root dropout key ``rng``
        (``trainers.train_mode``): the same masks on the ghost and the vmap(grad) paths."""
        return self._clipped_sum_of(self.spec.training(rng))

    def _clipped_sum_of(self, model: Any) -> Callable:
        """``clipped(params, x, y, mask, clip_norm)`` on the ghost or the vmap(grad) path for
        ``model``: the spec, or its ``TrainingCall`` (per-example dropout keyed by each
        example's slot in the chunk). With a trainable part, only the trainable leaves are
        differentiated and clipped (zeros at the frozen ones)."""
        copies = self.augmult > 0
        loss = self.spec.loss or dpsgd.per_example_loss
        if self.grad_impl == "ghost":
            return functools.partial(
                ghost.clipped_sum_ghost, model, loss, copies=copies, trainable=self.trainable
            )
        per_slot = isinstance(model, train_mode.TrainingCall)
        apply_fn = model.apply_slots if per_slot else model.apply
        naive = functools.partial(
            dpsgd.clipped_sum_naive, loss=loss, copies=copies, per_slot=per_slot
        )
        if self.trainable is None:
            return functools.partial(naive, apply_fn)
        return finetune.masked_clipped_sum(naive, apply_fn, self.trainable)

    def _accumulate(
        self, params, gsum, loss, data_x, data_y, idx, mask, clip_norm, key=None, step=0, chunk=0
    ):
        """Running totals plus one more chunk's clipped gradient sum and loss sum. ``key``, ``step``
        and ``chunk`` (the candidate key, step and chunk index) only seed the augmentation."""
        gsum, (loss, _) = self._accumulate_counted(
            params, gsum, (loss, 0), data_x, data_y, idx, mask, clip_norm, key, step, chunk
        )
        return gsum, loss

    def _accumulate_counted(
        self, params, gsum, totals, data_x, data_y, idx, mask, clip_norm, key=None, step=0,
        chunk=0,
    ):  # fmt: skip
        """:meth:`_accumulate` with ``totals = (loss sum, dropped count)``: the count of examples
        dropped from the clipped sums (``dpsgd.count_dropped``, () int32) runs on with the loss.
        Its parameters and sums are :meth:`_accumulate`'s, bitwise: the count only reads the
        per-example norms."""
        loss, dropped = totals
        g, lo, d = self._chunk_terms(params, data_x, data_y, idx, mask, clip_norm, key, step, chunk)
        return jax.tree_util.tree_map(jnp.add, gsum, g), (loss + lo, dropped + d)

    def _step(
        self, params, opt_state, gsum, loss, data_x, data_y, idx, mask, key, step, clip_norm,
        sigma, expected_batch,
    ):  # fmt: skip
        """One DP-SGD step: clipped sum of the main chunk plus the running totals of the tail chunks
        (zeros if none), Gaussian noise keyed by (candidate key, step), division by the expected
        batch size, optimiser update. Returns (params, opt_state, loss sum of the batch)."""
        params, opt_state, (loss, _) = self._step_counted(
            params, opt_state, gsum, (loss, 0), data_x, data_y, idx, mask, key, step, clip_norm,
            sigma, expected_batch,
        )  # fmt: skip
        return params, opt_state, loss

    def _step_counted(
        self, params, opt_state, gsum, totals, data_x, data_y, idx, mask, key, step, clip_norm,
        sigma, expected_batch,
    ):  # fmt: skip
        """:meth:`_step` with ``totals = (loss sum, dropped count)`` (as
        :meth:`_accumulate_counted`); returns (params, opt_state, totals)."""
        gsum, totals = self._accumulate_counted(
            params, gsum, totals, data_x, data_y, idx, mask, clip_norm, key, step, 0
        )
        noisy = dpsgd.add_noise(
            gsum, jax.random.fold_in(key, step), sigma, clip_norm, mask=self.trainable
        )
        grads = jax.tree_util.tree_map(lambda g: g / expected_batch, noisy)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if self.trainable is not None:  # frozen leaves: the arrays that came in, bitwise
            new_params = finetune.keep_frozen(new_params, params, self.trainable)
        return new_params, opt_state, totals

    def _run_chunk(
        self, accumulate, part, params, acc, epoch, data_x, data_y, key, clip_norm, t
    ):  # fmt: skip
        """``accumulate`` (:meth:`_accumulate_counted`) on chunk ``j`` of step ``t`` of an epoch
        whose batches are on the device, for ``acc = (gsum, totals, j)`` (``totals``: the loss
        sum and the dropped count; ``j`` counts the step's chunks, body chunks first, then tail
        chunks); returns ``(gsum, totals, j + 1)``. ``part`` (static): "body" or "tail", the
        array the chunk is in. No host value: the indices, mask and step number are read on the
        device (``epoch``: see :meth:`_run_step`)."""
        gsum, totals, j = acc
        at = j if part == "body" else j - epoch["body_idx"].shape[1]
        idx, mask = epoch[part + "_idx"][t, at], epoch[part + "_mask"][t, at]
        gsum, totals = accumulate(
            params, gsum, totals, data_x, data_y, idx, mask, clip_norm, key, epoch["step"][t], j
        )
        return gsum, totals, j + 1

    def _run_step(
        self, step, params, opt_state, acc, epoch, data_x, data_y, key, clip_norm, sigma,
        expected_batch, t,
    ):  # fmt: skip
        """``step`` (:meth:`_step_counted`) on body chunk 0 of step ``t`` of an epoch whose batches
        are on the device, adding ``acc = (gsum, totals, j)`` (the step's other chunks, from
        :meth:`_run_chunk`; ``totals``: the loss sum and the count of examples dropped from the
        clipped sums, () float32 and () int32 per candidate, running on over the epoch); returns
        ``(params, opt_state, totals, t + 1)``. No host value: a step costs no host-to-device
        transfer.

        ``epoch`` (``trainers.loop`` builds it; K > 1 adds a candidate axis after the chunk
        axis): ``body_idx`` / ``body_mask`` (steps, body chunks, chunk size), ``tail_idx`` /
        ``tail_mask`` (steps, tail chunks, tail size), ``step`` / ``noise_step`` (steps,) the
        step's index and the index its noise key is folded with. Each chunk is its own program,
        as in the step-by-step loop, not a loop inside one: XLA on CPU ran a step about 2x slower
        inside a while loop."""
        gsum, totals, _ = acc
        params, opt_state, totals = step(
            params, opt_state, gsum, totals, data_x, data_y, epoch["body_idx"][t, 0],
            epoch["body_mask"][t, 0], key, epoch["noise_step"][t], clip_norm, sigma,
            expected_batch,
        )  # fmt: skip
        return params, opt_state, totals, t + 1


def get_step_functions(
    model: Any, num_classes: int, optimizer: str, grad_impl: str, augmult: int = 0,
    ema: bool = False, mesh: Any = None,
) -> StepFunctions:  # fmt: skip
    """Cached :class:`StepFunctions`, so that every candidate with the same structure reuses the
    compiled step (the cache key is the full argument tuple, however the call spells it; a user's
    model is keyed by its ``ModelSpec`` object, compared by identity). With a ``mesh``
    (``trainers.parallel``), the clipped sums are computed data-parallel over it."""
    if grad_impl == "naive":
        grad_impl = "vmap"
    return _cached_step_functions(
        model, int(num_classes), optimizer, grad_impl, int(augmult), bool(ema), mesh
    )


@functools.lru_cache(maxsize=32)
def _cached_step_functions(
    model, num_classes, optimizer, grad_impl, augmult, ema, mesh
) -> StepFunctions:
    return StepFunctions(model, num_classes, optimizer, grad_impl, augmult, ema, mesh)


def _eval_params(params, opt_state, ema: bool):
    """What a candidate outputs: the parameter average with EMA, else the last iterate. With a
    trainable part the optimiser is ``optax.masked`` and averages the trainable leaves only; the
    frozen ones are the parameters' own."""
    if not ema:
        return params
    if isinstance(opt_state, optax.MaskedState):
        return finetune.fill_from(opt_state.inner_state.ema, params)
    return opt_state.ema
