r"""Peak memory of dptune's compiled DP-SGD step per model, expected batch size and augmentation
multiplicity, from XLA's own buffer assignment (``jax.jit(...).lower(...).compile()
.memory_analysis()``): nothing is run, so it works for batch sizes that would not fit, on any
backend (CPU here; run it on a GPU to get that backend's numbers).

A training step processes the Poisson batch in chunks of at most ``microbatch_size`` examples
(trainers.step.default_microbatch_size): ``accumulate`` adds one chunk's clipped sum to running
totals, the fused ``step`` adds the last chunk, the noise and the optimiser update. Chunks run one
after another, so the step's peak is the larger of the two compiled functions' peaks, whatever the
expected batch size. For comparison the script also compiles the step on the whole expected batch
as one chunk (no micro-batching).

Columns (MiB): temp = XLA temporaries of one call; args = parameters, optimiser state, running
sums, the index/mask chunk (the training set is excluded: it is resident once, listed below the
table); peak = args + temp + outputs - aliased.

    python scripts/memory_dpsgd.py                       # the table of docs/performance.md
    python scripts/memory_dpsgd.py --models cifar_cnn --batches 256 --augmult 0,4
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

MiB = 2.0**20


def _compiled_memory(fn, args) -> dict[str, float]:
    """memory_analysis() of ``fn`` compiled for ``args`` (ShapeDtypeStructs), in MiB."""
    m = fn.lower(*args).compile().memory_analysis()
    if m is None:  # some backends do not report
        return {"temp": float("nan"), "args": float("nan"), "peak": float("nan")}
    return {
        "temp": m.temp_size_in_bytes / MiB,
        "args": m.argument_size_in_bytes / MiB,
        "out": m.output_size_in_bytes / MiB,
        "alias": m.alias_size_in_bytes / MiB,
        "peak": (
            m.argument_size_in_bytes
            + m.temp_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
        )
        / MiB,
    }


def measure(model: str, batch: int, augmult: int, chunk: int | None, n_train: int) -> dict:
    """Peak memory of the compiled step for one configuration; ``chunk=None``: the default
    micro-batch size; ``chunk=0``: the whole expected batch as one chunk."""
    import jax
    import jax.numpy as jnp

    from trainers import models
    from trainers.spec import Hyperparams
    from trainers.step import (
        default_grad_impl,
        default_microbatch_size,
        get_step_functions,
        make_optimizer,
    )

    spec = models.get_model(model)
    impl = default_grad_impl(model, spec.input_shape, augmult)
    fns = get_step_functions(model, 10, "momentum", impl, augmult, False)
    size = batch if chunk == 0 else (chunk or default_microbatch_size(model, augmult))
    size = min(size, batch)
    sds = jax.ShapeDtypeStruct
    params = jax.eval_shape(lambda: models.init_params(spec, jax.random.PRNGKey(0)))
    opt_state = jax.eval_shape(lambda p: make_optimizer(Hyperparams(optimizer="momentum")).init(p),
                               params)  # fmt: skip
    f32, i32 = jnp.float32, jnp.int32
    data_x = sds((n_train, *spec.input_shape), f32)
    data_y = sds((n_train,), i32)
    idx, mask = sds((size,), i32), sds((size,), f32)
    key = sds((2,), jnp.uint32)
    scalar_f, scalar_i = sds((), f32), sds((), i32)
    step_args = (params, opt_state, params, scalar_f, data_x, data_y, idx, mask, key, scalar_i,
                 scalar_f, scalar_f, scalar_f)  # fmt: skip
    acc_args = (params, params, scalar_f, data_x, data_y, idx, mask, scalar_f, key, scalar_i,
                scalar_i)  # fmt: skip
    t0 = time.perf_counter()
    step = _compiled_memory(fns.step, step_args)
    acc = _compiled_memory(fns.accumulate, acc_args) if size < batch else None
    data_mib = (np.prod(data_x.shape) * 4 + n_train * 4) / MiB
    worst = step if acc is None or acc["peak"] <= step["peak"] else acc
    return {
        "model": model, "params": models.param_count(params), "batch": batch, "augmult": augmult,
        "chunk": size, "chunks": -(-batch // size), "impl": impl,
        "temp": worst["temp"], "args": worst["args"] - data_mib, "peak": worst["peak"] - data_mib,
        "data": data_mib, "compile_s": time.perf_counter() - t0,
    }  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cnn26k,cifar_cnn,wrn16_4")
    parser.add_argument("--batches", default="256,4096")
    parser.add_argument("--augmult", default="0,16", help="comma-separated K values")
    parser.add_argument("--whole", action="store_true", help="also the batch as one chunk")
    parser.add_argument("--microbatch", type=int, default=None, help="override the default")
    args = parser.parse_args()
    import jax

    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}); jax "
          f"{jax.__version__}; {platform.machine()}, {os.cpu_count()} cores")  # fmt: skip
    print("| model | params | B | K | path | chunk x chunks | temp MiB | args MiB | peak MiB |")
    print("|---|---:|---:|---:|---|---|---:|---:|---:|")
    data = {}
    for model in args.models.split(","):
        n_train = 45000 if model != "cnn26k" else 55000  # CIFAR-10 / MNIST minus 5k validation
        for batch in (int(b) for b in args.batches.split(",")):
            for k in (int(a) for a in args.augmult.split(",")):
                if model == "cnn26k" and k:
                    continue  # augmentation is for the CIFAR models
                chunks = [args.microbatch] + ([0] if args.whole else [])
                for chunk in chunks:
                    try:
                        r = measure(model, batch, k, chunk, n_train)
                    except Exception as e:  # noqa: BLE001 -- e.g. XLA:GPU cannot even compile it
                        # (its autotuner allocates buffers of the step's size): record and go on.
                        tag = "whole batch" if chunk == 0 else f"default ({chunk or 'auto'})"
                        why = str(e).splitlines()[0][:90]
                        print(f"| {model} | | {batch} | {k} | | {tag} | does not compile: {why} "
                              "| | |", flush=True)  # fmt: skip
                        continue
                    data[model] = r["data"]
                    tag = "whole batch" if chunk == 0 else f"{r['chunk']} x {r['chunks']}"
                    print(f"| {model} | {r['params']:,} | {batch} | {k} | {r['impl']} | {tag} | "
                          f"{r['temp']:,.0f} | {r['args']:,.0f} | {r['peak']:,.0f} |",
                          flush=True)  # fmt: skip
    for model, mib in data.items():
        print(f"resident training set for {model}: {mib:,.0f} MiB (float32), not in the table")


if __name__ == "__main__":
    main()
