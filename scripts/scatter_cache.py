"""Fill the scattering-feature cache for a dataset once, before tuning, and say how long it took.

The ``scatter_linear`` / ``scatter_cnn`` models compute (and cache, per record) the features of
every image they see on first use (``trainers.scatter``); this script does it up front so that
the first tuning run's wall time is training only, and prints the cost. The cache is keyed by each
record's own pixels, so the training/validation split and its seed do not matter here.

Privacy: the transform is a fixed function of each record alone (no privacy cost); the cache holds
a function of the private images, as sensitive as the data (``docs/scattering.md``). Nothing is
printed about the data beyond the number of records read.

    python scripts/scatter_cache.py --name fashion_mnist --data_dir /path/to/fashion-mnist
    python scripts/scatter_cache.py --name mnist --data_dir '<shipped:mnist-10k>'
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import numpy as np


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="mnist | fashion_mnist")
    ap.add_argument("--data_dir", required=True, help="IDX folder, or <shipped:mnist-10k>")
    ap.add_argument("--backend", choices=("jax", "numpy"), default=None)
    ap.add_argument("--limit", type=int, default=None, help="only the first N images (a test)")
    args = ap.parse_args(argv)

    import jax

    from trainers import scatter
    from trainers.data import load_dataset

    data_dir, num = args.data_dir, None
    if data_dir == "<shipped:mnist-10k>":
        from dptune.data import MNIST_10K_DIR, MNIST_10K_NUM_TRAIN

        data_dir, num = str(MNIST_10K_DIR), MNIST_10K_NUM_TRAIN
    data = load_dataset(args.name, data_dir, source="idx", num_examples=num)
    images = np.concatenate([data.train_x, data.val_x, data.test_x])[: args.limit]
    cache = scatter.FeatureCache(backend=args.backend)
    t0 = time.perf_counter()
    cache.features(images)
    seconds = time.perf_counter() - t0
    out = {
        "records": int(len(images)),
        "computed": int(cache.computed),
        "seconds": round(seconds, 1),
        "backend": cache.backend,
        "jax_devices": [str(d) for d in jax.devices()],
        "cache_folder": str(cache.folder),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
