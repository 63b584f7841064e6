"""The DP-SGD training loop: one or K candidates, from their keys to their (private) results.

``train_candidates`` groups structurally identical candidates and trains each group in lockstep
through one code path for any group size K >= 1 (``trainers.step.Group`` lays the candidates'
values out for its compiled step: one candidate at a time on CPU, with the plain jitted step,
where vmap was measured slower; K at once, vmapped, on accelerators). The step count and sampling
rate come from ``trainers.spec.dpsgd_privacy`` on the PUBLIC nominal size, so the accountant and
the loop agree.
Everything a ``CandidateResult`` holds is private to the curator.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from trainers import models, parallel, probe, scatter
from trainers.data import Dataset
from trainers.evaluate import device_arrays, model_data, validation_score
from trainers.sampling import PoissonSampler
from trainers.spec import (
    FAILURE_SCORE,
    CandidateResult,
    DpSgdSchedule,
    Hyperparams,
    dpsgd_privacy,
)
from trainers.step import (
    _eval_params,
    default_microbatch_size,
    get_step_functions,
    optimizer_numbers,
    resolve_grad_impl,
)

log = logging.getLogger(__name__)

Progress = Callable[[dict], None]


def _as_key(key) -> np.ndarray:
    """The raw uint32[2] data of a candidate key, on the host (typed keys are unwrapped)."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    key = np.asarray(key)
    if key.dtype != np.uint32 or key.shape != (2,):
        raise ValueError(
            f"key must be a jax PRNG key (typed or uint32[2]); got {key.dtype}{key.shape}"
        )
    return key


def _numpy_rng(key: jax.Array) -> np.random.Generator:
    """numpy Generator for Poisson sampling, seeded by the (secret) candidate key."""
    return np.random.Generator(np.random.PCG64(np.asarray(key).tolist()))


def _check(hp: Hyperparams, data: Dataset) -> None:
    spec = models.resolve(hp.model, data.num_classes)
    if spec.features == "scatter":
        scatter.kymatio_version()  # raises KymatioMissingError with how to install it
        if tuple(data.train_x.shape[1:]) != (*scatter.IMAGE_HW, 1):
            raise ValueError(
                f"model {hp.model!r} computes scattering features of 28x28x1 images, but dataset "
                f"{data.name!r} has {tuple(data.train_x.shape[1:])}"
            )
    elif tuple(data.train_x.shape[1:]) != spec.input_shape:
        raise ValueError(
            f"model {spec.name!r} expects {'images' if spec.shipped else 'inputs'} of shape "
            f"{spec.input_shape}, but dataset "
            f"{data.name!r} has "
            f"{tuple(data.train_x.shape[1:])}"
        )
    elif not spec.shipped and data.train_x.dtype != np.dtype(spec.input_dtype):
        raise ValueError(
            f"model {spec.name!r} was built for {spec.input_dtype} inputs, but dataset "
            f"{data.name!r} holds {data.train_x.dtype}"
        )
    if hp.augmult > 0 and (
        len(data.train_x.shape) != 4 or not np.issubdtype(data.train_x.dtype, np.floating)
    ):
        raise ValueError(
            f"augmult={hp.augmult} augments images (crops and flips of (height, width, channels) "
            f"float arrays), but the inputs have shape {tuple(data.train_x.shape[1:])} "
            f"({data.train_x.dtype}): use augmult=0"
        )
    dpsgd_privacy(hp, data.public_num_train)  # raises if N < B
    # Decided on public quantities only: the expected validation size, and the length
    # of a validation set declared public. A private split that happens to be empty is scored
    # like its neighbour with one record (a noisy count of 0 over the public size).
    if data.public_num_val <= 0 or (data.validation_public and len(data.val_x) == 0):
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


def check_inputs(hp: Hyperparams, data: Dataset) -> None:
    """The checks ``train_candidates`` makes before training (model vs image shape, the sizes,
    the score's noise), for a caller that wants them before any private computation: they read
    the data's public schema and sizes only. Raises ValueError."""
    _check(hp, data)


def same_step(step: int) -> int:
    """``train_candidates``' default ``noise_step``: step ``step`` folds its noise key with
    ``step`` itself (fresh noise at every step)."""
    return step


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
      grad_impl: "auto" (default: :func:`trainers.step.default_grad_impl`), "vmap", "ghost" or
        "bookkeeping" (``trainers.step.GRAD_IMPLS``; "naive" = "vmap").
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
    mesh: Any = None,
    noise_step: Callable[[int], int] = same_step,
) -> list[CandidateResult]:
    """Trains K candidates; results in the order of ``hps``.

    ``vectorize=None`` (auto) trains structurally identical candidates (same model, optimiser, batch
    size, epochs) together with ``vmap`` where a short measurement on this device found it faster
    (``trainers.probe``: on the project's CPUs it was slower), else one after another. Each
    candidate keeps its own key, so results do not depend on the grouping (up to float rounding).
    Progress dicts carry the candidate's index in "candidate".

    ``mesh`` (default: the one set by ``trainers.parallel.data_parallel``, if any): train each
    candidate data-parallel over its devices, one candidate at a time (``trainers.parallel``); the
    same key gives the same candidate as on one device, up to float summation order.

    ``noise_step(step)`` is the index step ``step``'s noise key is folded with: the step itself
    (default), so every step draws fresh noise; only an audit's negative control passes another.
    """
    if mesh is None:
        mesh = parallel.current_mesh()
    if mesh is not None and mesh.size == 1:
        mesh = None  # one device: the ordinary path
    if mesh is not None:
        vectorize = False
    hps = list(hps)
    keys = [_as_key(k) for k in keys]
    if len(hps) != len(keys):
        raise ValueError(f"got {len(hps)} hyperparameter sets but {len(keys)} keys")
    for hp in hps:
        _check(hp, data)
    if vectorize is None:  # measured per model and device (trainers.probe), not by platform name
        shape = data.train_x.shape[1:]
        choice = probe.choose_for(hps, data.num_classes, shape, grad_impl=grad_impl)
        vectorize = choice is not None and choice.vectorize
    results: list[CandidateResult | None] = [None] * len(hps)
    groups: dict[tuple, list[int]] = {}
    for i, hp in enumerate(hps):
        sig = (
            hp.model, hp.optimizer, hp.batch_size, hp.epochs, hp.augmult,
            hp.ema_decay is None, hp.microbatch_size,
        )  # fmt: skip
        groups.setdefault(sig if vectorize else (i,), []).append(i)
    for members in groups.values():
        hp_m = hps[members[0]]
        impl = resolve_grad_impl(hp_m.model, grad_impl, data.train_x.shape[1:], hp_m.augmult)
        gdata = model_data(data, hp_m.model)  # scattering features for the scatter models
        group = _train_group(
            [hps[i] for i in members], gdata, [keys[i] for i in members], members, progress,
            progress_every, impl, on_epoch, mesh, noise_step,
        )  # fmt: skip
        for i, r in zip(members, group, strict=True):
            results[i] = r
    return results  # type: ignore[return-value]


def _train_group(
    hps, data, keys, indices, progress, progress_every, impl, on_epoch, mesh=None,
    noise_step=same_step,
) -> list[CandidateResult]:  # fmt: skip
    try:
        return _train_group_unsafe(
            hps, data, keys, indices, progress, progress_every, impl, on_epoch, mesh, noise_step
        )
    except Exception as e:  # a candidate must never abort the search (OOM, XLA errors, ...)
        if len(hps) > 1:  # retry one by one so that one bad candidate does not fail its group
            rest = (progress, progress_every, impl, on_epoch, mesh, noise_step)
            return [
                _train_group([hp], data, [k], [i], *rest)[0]
                for hp, k, i in zip(hps, keys, indices, strict=True)
            ]
        log.warning("candidate %d failed with %s", indices[0], type(e).__name__)
        return [
            CandidateResult(
                None, FAILURE_SCORE, [], True, f"{type(e).__name__}: {e}", traceback.format_exc()
            )
        ]


def _train_group_unsafe(
    hps, data, keys, indices, progress, progress_every, impl, on_epoch, mesh=None,
    noise_step=same_step,
):  # fmt: skip
    """Trains a group of K >= 1 structurally identical candidates in lockstep. Per-candidate values
    are laid out by the group (``trainers.step.Group``: a leading candidate axis for K > 1), so
    this one path serves every K. With a ``mesh``, K is 1 and each chunk's clipped sum is computed
    data-parallel over it."""
    hp0 = hps[0]
    k = len(hps)
    ema = hp0.ema_decay is not None
    fns = get_step_functions(
        hp0.model, data.num_classes, hp0.optimizer, impl, hp0.augmult, ema, mesh
    )
    group = fns.group(k)
    chunk = hp0.microbatch_size or default_microbatch_size(hp0.model, hp0.augmult, impl)
    data_x, data_y = device_arrays(data)
    if data_x.shape[0] == 0:  # no private record: one zero record for the (masked) padding slots
        data_x, data_y = (jnp.zeros((1, *a.shape[1:]), a.dtype) for a in (data_x, data_y))
    shards = 1
    replicated = None
    if mesh is not None:
        # Every device gathers its shard of each chunk from its own copy of the data.
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        data_x, data_y = jax.device_put(data_x, replicated), jax.device_put(data_y, replicated)
        shards = mesh.size
    # Privacy parameters from the PUBLIC nominal size: q = B / N_public and the step count; the
    # sampler then includes each of the actual records with probability q (Poisson sampling does
    # not need the actual size to be public, the accountant's q does).
    schedule = DpSgdSchedule.from_hyperparams(hp0, data.public_num_train)
    total_steps = schedule.steps
    # init, sampling, noise, score: split on the device, kept as host rows.
    subkeys = [np.asarray(jax.random.split(jax.device_put(key), 4)) for key in keys]
    samplers = [_sampler(len(data.train_x), schedule, chunk, sk[1]) for sk in subkeys]
    params, opt_states, consts = _group_start(fns, group, hps, subkeys)
    histories: list[list[dict]] = [[] for _ in hps]
    failed = [False] * k
    dropped = np.zeros(k, np.int64)
    last_good = params
    step = 0
    for epoch in range(hp0.epochs):
        t0 = time.perf_counter()
        batches, chunks, n_seen = _epoch_batches(
            samplers, schedule.steps_per_epoch, step, noise_step, shards
        )
        # The epoch's batches go to the device in one transfer (to every device of a mesh, like
        # the data); the steps then read them there, so a step costs no host-to-device transfer.
        batches = jax.device_put(batches, replicated)

        def on_step(step, epoch=epoch):
            if progress is not None and progress_every > 0 and step % progress_every == 0:
                for i in indices:
                    progress(_progress_dict("step", i, epoch, hp0.epochs, step, total_steps))

        params, opt_states, totals, step = _run_epoch(
            group, params, opt_states, consts, batches, chunks, data_x, data_y, step, on_step
        )
        # Failure is decided from the parameters alone (post-processing of the DP output), never
        # from the loss.
        out = _eval_params(params, opt_states, ema)
        finite = group.finite((params, out))
        _record_epoch(histories, failed, dropped, finite, totals, n_seen, epoch + 1, step, t0)
        if all(failed):
            break
        last_good = group.keep_finite(last_good, out, finite)
        if on_epoch is not None:
            for c, i in enumerate(indices):
                if not failed[c]:
                    on_epoch(i, epoch + 1, group.row(out, c))
        if progress is not None:
            for i in indices:
                progress(_progress_dict("epoch", i, epoch, hp0.epochs, step, total_steps))
    return _group_results(hps, data, group, last_good, failed, histories, dropped, subkeys)


def _sampler(n_train: int, schedule: DpSgdSchedule, chunk: int, key) -> PoissonSampler:
    """The sampler ``DpSgdSchedule.sampler`` builds (each of the ``n_train`` actual records at the
    accountant's rate q), drawing from ``key`` on the host, in chunks of at most ``chunk``."""
    return PoissonSampler(
        n_train, schedule.batch_size, _numpy_rng(key), sampling_rate=schedule.sampling_rate,
        max_chunk=chunk,
    )  # fmt: skip


class _StepConstants(NamedTuple):
    """The device values every step of a group reads: per candidate (the group's layout) the noise
    keys, clipping norms and noise multipliers; the expected batch size; the zeros an epoch's
    sums start from (the clipped sum, and the (loss sum, dropped count) totals)."""

    noise_keys: Any
    clip: Any
    sigma: Any
    expected_b: Any
    zero_sum: Any
    zero_totals: tuple
    zero: Any
    one: Any


def _group_start(fns, group, hps, subkeys) -> tuple[Any, Any, _StepConstants]:
    """The group's initial parameters and optimiser states (from each candidate's ``subkeys[c][0]``)
    and its step constants (noise from ``subkeys[c][2]``). Host values are built with NumPy and
    copied (jax.device_put), device values derived in a few compiled programs: an eager jnp
    operation compiles a program of its own per shape, and even a warm start traces and looks up
    each one."""
    k = len(hps)
    inits = [models.init_params(fns.spec, jax.device_put(sk[0])) for sk in subkeys]
    # make_optimizer(hp).init(params), compiled once for the structure
    opt_states = group.stack(
        [fns.init_opt(p, optimizer_numbers(hp)) for p, hp in zip(inits, hps, strict=True)]
    )
    params = group.stack(inits)
    consts = _StepConstants(
        noise_keys=group.stack([sk[2] for sk in subkeys]),
        clip=group.stack([np.float32(hp.clip_norm) for hp in hps]),
        sigma=group.stack([np.float32(hp.noise_multiplier) for hp in hps]),
        expected_b=jax.device_put(np.float32(hps[0].batch_size)),
        zero_sum=jax.tree_util.tree_map(
            lambda a: jax.device_put(np.zeros(a.shape, a.dtype)), params
        ),
        # The epoch's loss sum and count of examples dropped from the clipped sums (their
        # gradient norm was not finite), per candidate, on the device; read once per epoch.
        zero_totals=(group.stack([np.float32(0.0)] * k), group.stack([np.int32(0)] * k)),
        zero=jax.device_put(np.int32(0)),
        one=jax.device_put(np.int32(1)),
    )
    return params, opt_states, consts


def _run_epoch(
    group, params, opt_states, consts: _StepConstants, batches, chunks, data_x, data_y,
    step: int, on_step: Callable[[int], None],
):  # fmt: skip
    """One epoch's steps (``chunks``: each step's number of body and tail chunks); returns the
    parameters, optimiser states, the epoch's device totals (loss sum, dropped count) and the
    step count. ``on_step(step)`` after each step."""
    c = consts
    totals, t = c.zero_totals, c.zero
    for body, tail in chunks:
        # Body chunks after the first (B > the microbatch size), then the tail chunks (~half
        # the steps, when the Poisson batch outgrows the body) go through `run_chunk`; the
        # fused step on the first chunk adds their sums, the noise and the optimiser update.
        # The loss runs on from the epoch's sum, so the step returns the sum so far.
        acc = (c.zero_sum, totals, c.one)
        for part, n in (("body", body - 1), ("tail", tail)):
            for _ in range(n):
                acc = group.run_chunk(
                    part, params, acc, batches, data_x, data_y, c.noise_keys, c.clip, t
                )
        params, opt_states, totals, t = group.run(
            params, opt_states, acc, batches, data_x, data_y, c.noise_keys, c.clip, c.sigma,
            c.expected_b, t,
        )  # fmt: skip
        step += 1
        on_step(step)
    return params, opt_states, totals, step


def _record_epoch(
    histories, failed, dropped, finite, totals, n_seen, epoch: int, step: int, t0: float
) -> None:
    """Appends the epoch's history row (its mean training loss, and the seconds since ``t0``) of
    each candidate still finite, adds its dropped count, and marks the candidates that became
    non-finite."""
    k = len(failed)
    loss_sum, dropped_now = jax.device_get(totals)
    losses = np.asarray(loss_sum, dtype=np.float64).reshape(k) / np.maximum(n_seen, 1)
    dropped_now = np.asarray(dropped_now, np.int64).reshape(k)
    seconds = time.perf_counter() - t0
    for c in range(k):
        if failed[c]:
            continue
        if not finite[c]:
            failed[c] = True
            continue
        # Counted over the epochs that end finite: once the parameters are NaN, every
        # gradient is, and the count would say nothing about the records.
        dropped[c] += dropped_now[c]
        histories[c].append(
            {"epoch": epoch, "steps": step, "train_loss": float(losses[c]), "seconds": seconds}
        )


def _group_results(
    hps, data, group, last_good, failed, histories, dropped, subkeys
) -> list[CandidateResult]:
    """Each candidate's result: its last finite parameters, scored on validation (key
    ``subkeys[c][3]``) unless it failed."""
    results = []
    for c, hp in enumerate(hps):
        p = jax.tree_util.tree_map(np.asarray, group.row(last_good, c))
        if failed[c]:
            why = (
                "NonFiniteParameters: the parameters became NaN or infinite in epoch "
                f"{len(histories[c]) + 1} (a smaller learning rate or clipping norm may help)"
            )
            results.append(
                CandidateResult(p, FAILURE_SCORE, histories[c], True, why, dropped=int(dropped[c]))
            )
        else:
            score = validation_score(hp, p, data, jax.device_put(subkeys[c][3]))
            results.append(CandidateResult(p, score, histories[c], False, dropped=int(dropped[c])))
    return results


def _epoch_batches(
    samplers: list[PoissonSampler], steps: int, step0: int, noise_step: Callable[[int], int],
    shards: int,
) -> tuple[dict[str, np.ndarray], list[tuple[int, int]], np.ndarray]:  # fmt: skip
    """An epoch's Poisson batches for K candidates, laid out for ``StepFunctions.run_chunk`` /
    ``run_step`` (host arrays, fixed shapes, so the compiled programs serve every epoch); each
    step's number of body and tail chunks (the largest over the candidates); each candidate's
    number of sampled examples.

    Each sampler draws ``steps`` batches in order (its stream is exactly the one a step-by-step
    loop would draw) and lays each out in chunks (``PoissonSampler.chunks``); every chunk is
    padded to a multiple of ``shards`` slots (index 0, mask 0: the padding adds nothing to the
    clipped sum), so a data-parallel chunk splits evenly. Slots of chunks a candidate does not
    use are padding too; a step runs as many chunks as its largest candidate uses. Memory: about
    8 bytes per slot, (steps x capacity x K) slots."""
    s0 = samplers[0]
    k, nb = len(samplers), s0.num_body_chunks
    body, tail = s0.chunk_size + -s0.chunk_size % shards, s0.tail_size + -s0.tail_size % shards
    drawn = [[s.sample() for _ in range(steps)] for s in samplers]
    used = [[len(s.chunk_sizes(len(b))) for b in bs] for s, bs in zip(samplers, drawn, strict=True)]
    # The capacity's tail chunks (overflow probability < 1e-9); a larger batch gets more chunks.
    n_tail = max([s0.num_tail_chunks] + [u - nb for us in used for u in us])
    out = {
        "body_idx": np.zeros((steps, nb, k, body), np.int32),
        "body_mask": np.zeros((steps, nb, k, body), np.float32),
        "tail_idx": np.zeros((steps, n_tail, k, tail), np.int32),
        "tail_mask": np.zeros((steps, n_tail, k, tail), np.float32),
    }
    for c, (s, bs) in enumerate(zip(samplers, drawn, strict=True)):
        for t, b in enumerate(bs):
            for j, (idx, mask) in enumerate(s.chunks(b)):
                name, at = ("body", j) if j < nb else ("tail", j - nb)
                out[name + "_idx"][t, at, c, : len(idx)] = idx
                out[name + "_mask"][t, at, c, : len(mask)] = mask
    most = np.max(np.asarray(used, np.int32), axis=0)
    chunks = [(min(m, nb), max(m - nb, 0)) for m in most.tolist()]
    out["step"] = np.arange(step0, step0 + steps, dtype=np.int32)
    out["noise_step"] = np.asarray([noise_step(i) for i in out["step"].tolist()], np.int32)
    if k == 1:  # the group's layout: no candidate axis for one candidate
        for name in ("body_idx", "body_mask", "tail_idx", "tail_mask"):
            out[name] = out[name][:, :, 0]
    n_seen = np.asarray([sum(len(b) for b in bs) for bs in drawn], np.float64)
    return out, chunks, n_seen


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
