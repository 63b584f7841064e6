r"""Exploratory: where a small model's DP step spends its time on an accelerator.

For the user CNN and cnn26k at batch 256 it times, interleaved, one jitted DP step written five
ways -- (a) the generic step closing over its constants (vmap(grad) clipped sum), (b) dptune's
``StepFunctions.step`` with the vmap clipped sum called as the accelerator suite calls it (numpy
index/mask and fresh scalars each call), (c) the same with every argument already on the device,
(d) dptune's automatic path (ghost / book-keeping) with device arguments, (e) jax_privacy 2.0 --
and prints each compiled step's count of kernels (fusions, convolutions, custom calls) from the
optimised HLO. Not a benchmark of record: a diagnosis, reported as such.

    python scripts/diag_step_overhead.py [--steps 100 --rounds 5 --batch 256]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _bench_module():
    path = Path(__file__).with_name("bench_dpsgd.py")
    spec = importlib.util.spec_from_file_location("bench_dpsgd", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_dpsgd"] = mod
    spec.loader.exec_module(mod)
    return mod


def kernels(jitted, *args) -> str:
    try:
        text = jitted.lower(*args).compile().as_text()
    except Exception as e:  # noqa: BLE001
        return f"? ({type(e).__name__})"
    entry = text[text.rfind("ENTRY") :]
    fus = len(re.findall(r"= \S+ fusion\(", entry))
    conv = len(re.findall(r"convolution\(", entry))
    cc = len(re.findall(r"custom-call\(", entry))
    loops = len(re.findall(r" while\(", entry))
    ops = sum(1 for line in entry.splitlines() if " = " in line)
    return f"entry ops {ops}, fusions {fus}, conv {conv}, custom-calls {cc}, while {loops}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--models", default="user_cnn,cnn26k")
    args = p.parse_args()
    b = _bench_module()
    import jax
    import jax.numpy as jnp
    import optax

    from trainers import dpsgd, models
    from trainers.spec import Hyperparams
    from trainers.step import get_step_functions, make_optimizer, resolve_grad_impl

    rng = np.random.default_rng(0)
    hp = Hyperparams(learning_rate=b.LR, clip_norm=b.CLIP, noise_multiplier=b.SIGMA)
    rows, info = {}, {}
    batch, n = args.batch, 4096
    # Model-independent constants, on the device once.
    key = jax.random.PRNGKey(1)
    clip, sigma, bb = jnp.float32(b.CLIP), jnp.float32(b.SIGMA), jnp.float32(batch)
    f0, i0 = jnp.float32(0), jnp.int32(0)
    for name in args.models.split(","):
        spec = b._user_cnn_spec() if name == "user_cnn" else models.get_model(name)
        model = spec if name == "user_cnn" else name
        data_x = jax.device_put(rng.uniform(0, 1, (n, *spec.input_shape)).astype(np.float32))
        data_y = jax.device_put(rng.integers(0, 10, n).astype(np.int32))
        params0 = jax.jit(lambda k, spec=spec: models.init_params(spec, k))(jax.random.PRNGKey(0))
        idx_np = np.sort(rng.choice(n, batch, replace=False)).astype(np.int32)
        ones_np = np.ones(batch, np.float32)
        idx_d, ones_d = jax.device_put(idx_np), jax.device_put(ones_np)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params0)
        apply_fn = spec.module.apply
        dp_opt = make_optimizer(hp)

        @jax.jit
        def generic(
            params,
            opt_state,
            idx,
            apply_fn=apply_fn,
            data_x=data_x,
            data_y=data_y,
            dp_opt=dp_opt,
            ones=ones_d,
        ):
            gsum, loss, _ = dpsgd.clipped_sum_naive(
                apply_fn, params, data_x[idx], data_y[idx], ones, clip
            )
            noisy = dpsgd.add_noise(gsum, key, sigma, clip)
            grads = jax.tree_util.tree_map(lambda g: g / bb, noisy)
            updates, opt_state = dp_opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        st = dp_opt.init(params0)
        rows[f"{name}/a_generic_vmap"] = b._stateful_row(generic, params0, st, idx_np)
        info[f"{name}/a_generic_vmap"] = kernels(generic, params0, st, idx_np)
        auto = resolve_grad_impl(model, None, spec.input_shape)
        for label, impl, dev in (
            ("b_fns_vmap_numpy", "vmap", False),
            ("c_fns_vmap_device", "vmap", True),
            (f"d_fns_{auto}_device", auto, True),
        ):
            fns = get_step_functions(model, 10, "sgd", impl)

            if dev:

                def fused(
                    params,
                    opt_state,
                    idx,
                    fns=fns,
                    c=(zeros, data_x, data_y, idx_d, ones_d),
                ):
                    return fns.step(
                        params,
                        opt_state,
                        c[0],
                        f0,
                        c[1],
                        c[2],
                        c[3],
                        c[4],
                        key,
                        i0,
                        clip,
                        sigma,
                        bb,
                    )
            else:

                def fused(params, opt_state, idx, fns=fns, c=(zeros, data_x, data_y, ones_np)):
                    return fns.step(
                        params,
                        opt_state,
                        c[0],
                        jnp.float32(0),
                        c[1],
                        c[2],
                        idx,
                        c[3],
                        key,
                        jnp.int32(0),
                        clip,
                        sigma,
                        bb,
                    )

            rows[f"{name}/{label}"] = b._stateful_row(fused, params0, dp_opt.init(params0), idx_np)
            info[f"{name}/{label}"] = kernels(
                fns.step,
                params0,
                dp_opt.init(params0),
                zeros,
                f0,
                data_x,
                data_y,
                idx_d,
                ones_d,
                key,
                i0,
                clip,
                sigma,
                bb,
            )
        if b._have_jax_privacy():
            jp, _, jst = b.jax_privacy_step(apply_fn, params0, data_x, data_y, batch)
            rows[f"{name}/e_jax_privacy"] = b._stateful_row(jp, params0, jst, idx_np)
            info[f"{name}/e_jax_privacy"] = kernels(jp, params0, jst, idx_np)
    for fn in rows.values():
        for _ in range(3):
            b._block(fn())
    times = {k: [] for k in rows}
    for _ in range(args.rounds):
        for k, fn in rows.items():
            b._block(fn())
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = fn()
            b._block(out)
            times[k].append((time.perf_counter() - t0) / args.steps)
    dev = jax.devices()[0]
    print(
        f"device {dev.platform} {dev.device_kind}; jax {jax.__version__}; batch {batch}; "
        f"{args.rounds} rounds x {args.steps} steps"
    )
    for k in rows:
        print(f"{k:32s} {1e3 * statistics.median(times[k]):8.3f} ms   {info[k]}")


if __name__ == "__main__":
    main()
