"""The value of tuning where no recipe is known: released test accuracy of dptune's default tuning
against the untuned defaults of two DP libraries' tutorials and naive best-of-k, on tasks whose
data ship or are generated and whose models have no published DP recipe.

Tasks (``TASKS``; every one a user's model on arrays, through ``dptune.Dataset.from_arrays``):

* ``tabular``: an MLP (2 x 64, ReLU) on 12,000 generated rows of 24 features, 4 classes
  (``sklearn.datasets.make_classification``, fixed public seed; 2,000 rows are the test split).
* ``text``: a bag-of-embeddings classifier (Embed 1000 x 32, mean over tokens, Dense 32, Dense 2)
  on 12,000 generated "reviews" of 40 token ids; the label is the sign of a sum of hidden token
  polarities plus noise (fixed public seed).
* ``lm``: a tiny next-token transformer (one causal attention block, width 32) on 6,000
  generated sequences of 16 tokens from a fixed random Markov chain (vocabulary 32); metric: token
  accuracy; per-sequence loss: mean token cross-entropy (a sequence is one record).
* ``finetune``: the shipped ``finetune`` task (cnn26k pretrained on the public digits 0-4, tuned on
  the digits 5-9; ``dptune/configs/finetune.py``): the dptune and best-of-k arms use that config's
  recipe (Adam, small clip norms); the untuned arms start from the same public weights.
* ``cnn``: a user-written CNN (two 3x3 convolutions, as in jax_privacy's linen MNIST example) on
  12,000 Fashion-MNIST training images (``--fashion_dir``, IDX files; the project's copy is
  ``../shared/data/fashion-mnist``) and its 10,000 test images: a model whose recipe (MNIST) came
  from another dataset.

Arms, per task, total epsilon and repetition (OS entropy every time; no seed):

* ``dptune``: dptune's defaults for a user's model (``dptune/configs/user.py``: its search space,
  count of candidates, epochs, batch size and validation size, the size-dependent ones derived
  from the task's public size as a run derives them), noise calibrated so that the TOTAL meets
  the budget.
* ``opacus``: one untuned run at the defaults of Opacus's MNIST example (``examples/mnist.py`` of
  pytorch/opacus: SGD without momentum, learning rate 0.1, clip norm 1.0, batch 64, 10 epochs),
  the noise calibrated to the total epsilon (as ``make_private_with_epsilon`` would).
* ``jax_privacy``: one untuned run at the defaults of jax_privacy's linen MNIST example
  (``examples/dp_sgd_flax_linen_mnist.py``: SGD with momentum 0.9, learning rate 0.1 on gradients
  rescaled to unit norm, i.e. 0.1 / C in dptune's units, clip norm C = 0.1, expected batch 256),
  trained for dptune's default epochs (its 5,000 steps are 100+ epochs at these sizes: more than
  the benchmark's time allows), the noise calibrated to the total epsilon.
* ``best_of_k``: the best of k = round(mean) random candidates from dptune's space, priced
  honestly by composition (Liu & Talwar 2019, App. B.1).
* ``reference`` (NOT a release, not private): the best test accuracy among the ``dptune`` arm's
  own candidates after their last epoch, read from that run's private journal (their test curves):
  what tuning could have found, at no extra training.

Output in ``--out``: ``tuning_value.json`` (every run; resumable: a finished run is never rerun),
``tuning_value.md`` (median, 10th and 90th percentile per cell) and ``tuning_value.png``.

This is a benchmark on data without a budget to protect: every arm's accuracy is printed and the
epsilons of the runs compose; no ledger is charged. Declared runs go in ``results/`` with the
commit that declared them, and are run once.

    PYTHONPATH=. python scripts/tuning_value.py --out /tmp/tv --tasks tabular --eps 3 --reps 1 \\
        --small       # a quick look (tiny data, 1 epoch)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ARMS = ("dptune", "dptune_before", "opacus", "jax_privacy", "best_of_k")
LABELS = {
    "dptune": "dptune (its defaults, tuning included)",
    "dptune_before": "dptune's defaults before the held-out check (90e49a0)",
    "opacus": "untuned: Opacus example defaults",
    "jax_privacy": "untuned: jax_privacy example defaults",
    "best_of_k": "naive best-of-k (composition)",
    "reference": "non-private reference: best dptune candidate by exact test accuracy",
}
TEST_SIZE = 2_000  # generated tasks: the last rows are the public test split
DELTA = 1e-5


# --- tasks --------------------------------------------------------------------------------------


def _mlp(num_classes: int) -> Any:
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(64)(x))
            x = nn.relu(nn.Dense(64)(x))
            return nn.Dense(num_classes)(x)

    return MLP()


def _bag_of_embeddings(num_classes: int, vocab: int = 1000) -> Any:
    import flax.linen as nn

    class BagOfEmbeddings(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            h = nn.Embed(vocab, 32)(tokens).mean(axis=1)
            return nn.Dense(num_classes)(nn.relu(nn.Dense(32)(h)))

    return BagOfEmbeddings()


def _cnn(num_classes: int) -> Any:
    import flax.linen as nn

    class CNN(nn.Module):  # the layout of jax_privacy's linen MNIST example, narrower
        @nn.compact
        def __call__(self, x):
            x = nn.avg_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), (2, 2))
            x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
            return nn.Dense(num_classes)(nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1))))

    return CNN()


LM_VOCAB, LM_LENGTH = 32, 16


def _tiny_lm(num_classes: int, vocab: int = LM_VOCAB, length: int = LM_LENGTH) -> Any:
    import flax.linen as nn
    import jax.numpy as jnp

    class TinyLM(nn.Module):  # token ids (b, L) -> next-token logits (b, L, vocab)
        @nn.compact
        def __call__(self, tokens):
            pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            h = nn.Embed(vocab, 32)(tokens) + nn.Embed(length, 32)(pos)
            mask = nn.make_causal_mask(jnp.ones(tokens.shape))
            h = h + nn.MultiHeadDotProductAttention(2)(nn.LayerNorm()(h), mask=mask)
            h = h + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(h))))
            return nn.Dense(vocab)(nn.LayerNorm()(h))

    return TinyLM()


def _sequence_loss(logits, next_ids):
    import jax.numpy as jnp
    import optax

    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, next_ids), axis=-1)


def _token_accuracy(logits, next_ids):
    import jax.numpy as jnp

    return jnp.mean(jnp.argmax(logits, axis=-1) == next_ids, axis=-1)


def lm_arrays(
    n: int = 8_000,
    vocab: int = LM_VOCAB,
    length: int = LM_LENGTH,
    seed: int = 20261127,
    p: Sequence[float] = (0.6, 0.25, 0.15),
) -> tuple[np.ndarray, ...]:
    """Sequences of a fixed random first-order Markov chain (each token has len(p) likely
    successors), labels the next tokens: (n, L) ids and (n, L) next ids."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab, size=(vocab, len(p)))
    seq = np.empty((n, length + 1), np.int32)
    seq[:, 0] = rng.integers(0, vocab, n)
    for t in range(length):
        pick = rng.choice(len(p), size=n, p=list(p))
        seq[:, t + 1] = np.where(rng.random(n) < 0.1, rng.integers(0, vocab, n),
                                 succ[seq[:, t], pick])  # fmt: skip
    x, y = seq[:, :-1], seq[:, 1:]
    return x[:-TEST_SIZE], y[:-TEST_SIZE], x[-TEST_SIZE:], y[-TEST_SIZE:]


def finetune_arrays() -> tuple[np.ndarray, ...]:
    from dptune.configs.finetune import private_digits

    return private_digits()


def _shipped_cnn26k(num_classes: int) -> str:
    return "cnn26k"


def tabular_arrays(n: int = 12_000, **shape: Any) -> tuple[np.ndarray, ...]:
    from sklearn.datasets import make_classification

    kw = dict(n_features=24, n_informative=12, n_redundant=4, n_classes=4, class_sep=1.0,
              flip_y=0.02, random_state=20261127)  # fmt: skip
    x, y = make_classification(n_samples=n, **{**kw, **shape})
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    return x[:-TEST_SIZE], y[:-TEST_SIZE], x[-TEST_SIZE:], y[-TEST_SIZE:]


def text_arrays(
    n: int = 12_000, vocab: int = 1000, length: int = 40, seed: int = 20261127
) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    # Zipf-like token frequencies; 60 of the tokens carry a polarity of +-1, the rest none.
    freq = 1.0 / np.arange(1, vocab + 1) ** 1.1
    tokens = rng.choice(vocab, size=(n, length), p=freq / freq.sum()).astype(np.int32)
    polarity = np.zeros(vocab)
    carriers = rng.choice(np.arange(20, vocab), size=60, replace=False)
    polarity[carriers[:30]], polarity[carriers[30:]] = 1.0, -1.0
    # the carriers appear often enough to matter: each review gets 3 of them at random places
    slots = rng.integers(0, length, size=(n, 3))
    tokens[np.arange(n)[:, None], slots] = rng.choice(carriers, size=(n, 3))
    y = (polarity[tokens].sum(1) + rng.normal(0, 0.7, n) > 0).astype(np.int32)
    return tokens[:-TEST_SIZE], y[:-TEST_SIZE], tokens[-TEST_SIZE:], y[-TEST_SIZE:]


def fashion_arrays(folder: str, n: int = 12_000) -> tuple[np.ndarray, ...]:
    from trainers.data import load_dataset

    d = load_dataset("fashion_mnist", folder, source="idx", validation_size=0)
    # the first n training images (a fixed, public choice of records, not a private sample)
    return d.train_x[:n], d.train_y[:n], d.test_x, d.test_y


def fashion_finetune_arrays(folder: str, n: int = 4_000) -> tuple[np.ndarray, ...]:
    """Fashion-MNIST's classes 0-4 (T-shirt, trouser, pullover, dress, coat): the first ``n``
    such training images and every such test image, for the digits-0-4 start."""
    x, y, xt, yt = fashion_arrays(folder, n=60_000)
    keep, keep_t = y < 5, yt < 5
    return x[keep][:n], y[keep][:n], xt[keep_t], yt[keep_t]


@dataclasses.dataclass(frozen=True)
class Task:
    arrays: Callable[..., tuple[np.ndarray, ...]]
    model: Callable[[int], Any]
    num_classes: int  # 0: not class labels (the task's own loss and metric)
    loss: Callable | None = None
    metric: tuple[Callable, str] | None = None  # (per-example fn in [0, 1], name)
    finetune: bool = False  # the shipped finetune task: its start and its config's recipe
    fashion: bool = False  # its arrays read the Fashion-MNIST files (--fashion_dir)
    chance: float = 0.0  # a guess's score (a run that released nothing); 0: 1 / num_classes

    def load(self, fashion_dir: str) -> tuple[np.ndarray, ...]:
        """``(x_train, y_train, x_test, y_test)``."""
        return self.arrays(fashion_dir) if self.fashion else self.arrays()


TOKENS = (_token_accuracy, "token_accuracy")
TASKS = {
    "tabular": Task(tabular_arrays, _mlp, 4),
    "text": Task(text_arrays, _bag_of_embeddings, 2),
    "cnn": Task(fashion_arrays, _cnn, 10, fashion=True),
    "lm": Task(lm_arrays, _tiny_lm, 0, _sequence_loss, TOKENS, chance=1 / LM_VOCAB),
    "finetune": Task(finetune_arrays, _shipped_cnn26k, 5, finetune=True),
    # Held out: not looked at while the defaults were chosen (docs/privacy_utility.md, "Better
    # defaults"); other shapes, seeds and data than the tasks above.
    "tabular_b": Task(
        lambda: tabular_arrays(
            8_000,
            n_features=40,
            n_informative=10,
            n_redundant=10,
            n_classes=6,
            class_sep=0.8,
            flip_y=0.03,
            random_state=20261128,
        ),
        _mlp,
        6,
    ),  # fmt: skip
    "text_b": Task(
        lambda: text_arrays(10_000, vocab=2000, length=64, seed=20261128),
        lambda k: _bag_of_embeddings(k, vocab=2000),
        2,
    ),  # fmt: skip
    "lm_b": Task(
        lambda: lm_arrays(6_000, vocab=48, length=24, seed=20261128, p=(0.5, 0.2, 0.15, 0.1, 0.05)),
        lambda k: _tiny_lm(k, vocab=48, length=24),
        0,
        _sequence_loss,
        TOKENS,
        chance=1 / 48,
    ),  # fmt: skip
    "finetune_b": Task(fashion_finetune_arrays, _shipped_cnn26k, 5, finetune=True, fashion=True),
}


# --- arms ---------------------------------------------------------------------------------------


def user_defaults(num_examples: int) -> dict[str, Any]:
    """dptune's shipped defaults for a user's model of ``num_examples`` (public) records: the
    ``user`` config (``dptune/configs/user.py``) with its size-dependent fields filled as a run
    fills them (``suggested_settings``), as plain values."""
    from dptune.cli.build import _fill_suggested
    from dptune.configs import user

    c = json.loads(json.dumps(user.get_config().to_dict(), default=str))
    c["data"]["num_examples"] = int(num_examples)
    _fill_suggested(c)
    return c


def finetune_defaults() -> dict[str, Any]:
    """The shipped ``finetune`` config (dptune's recipe for fine-tuning its start), plain."""
    from dptune.configs import finetune

    return json.loads(json.dumps(finetune.get_config().to_dict(), default=str))


def defaults_before(num_examples: int, finetune: bool) -> dict[str, Any]:
    """dptune's defaults as they were before the held-out check (commit 90e49a0): for a user's
    model momentum SGD at lr 0.05 to 2 (whatever the batch), C 0.1 to 2, logarithmic count of
    mean 4 (2 below 5,000 records); for fine-tuning Adam, lr and C 1e-4 to 1e-2, 4 epochs at
    batch 512, logarithmic count of mean 3."""
    c = finetune_defaults() if finetune else user_defaults(num_examples)
    c["selection"]["method"] = "logarithmic"
    if finetune:
        c["train"].update(batch_size=512, epochs=4, optimizer="adam")
        lr, clip, mean = (1e-4, 1e-2), (1e-4, 1e-2), 3.0
    else:
        lr, clip, mean = (0.05, 2.0), (0.1, 2.0), 4.0 if num_examples >= 5000 else 2.0
    c["space"]["learning_rate"].update(low=lr[0], high=lr[1])
    c["space"]["clip_norm"].update(low=clip[0], high=clip[1])
    c["selection"]["mean_trials"] = mean
    return c


def arm_setup(arm: str, defaults: dict[str, Any], small: bool) -> tuple[dict, dict, Any]:
    """(base hyperparameters, search space, selection) of ``arm``."""
    from dptune import space
    from selection import BestOfK, RandomStopping

    train = defaults["train"]
    epochs = 1 if small else int(train["epochs"])
    keep = dict(score_noise_std=float(train["score_noise_std"]))
    if defaults.get("init"):  # the finetune task: its shipped model under its public start
        keep["model"] = train["model"]
    base = dict(batch_size=int(train["batch_size"]), epochs=epochs, optimizer=train["optimizer"],
                momentum=float(train.get("momentum", 0.9)), **keep)  # fmt: skip
    sp: dict[str, Any] = {"noise_multiplier": "auto"}
    for name in ("learning_rate", "clip_norm"):
        spec = defaults["space"][name]
        sp[name] = space.log_uniform(float(spec["low"]), float(spec["high"]))
    mean = float(defaults["selection"]["mean_trials"])
    if arm in ("dptune", "dptune_before"):
        return base, sp, getattr(RandomStopping, defaults["selection"]["method"])(mean)
    if arm == "best_of_k":
        return base, sp, BestOfK(max(1, round(mean)))
    if arm == "opacus":  # examples/mnist.py defaults (pytorch/opacus)
        base = dict(batch_size=64, epochs=1 if small else 10, optimizer="sgd", **keep)
        fixed = dict(learning_rate=0.1, clip_norm=1.0)
    elif arm == "jax_privacy":  # examples/dp_sgd_flax_linen_mnist.py defaults
        base = dict(base, batch_size=256, optimizer="momentum", momentum=0.9)
        fixed = dict(learning_rate=0.1 / 0.1, clip_norm=0.1)  # 0.1 on unit-rescaled gradients
    else:
        raise ValueError(f"unknown arm {arm!r}")
    one = {k: space.choice(v) for k, v in fixed.items()}
    return base, {**one, "noise_multiplier": "auto"}, BestOfK(1)


def _score(h: dict[str, Any]) -> float | None:
    """A per-epoch row's (or a release's) test score: accuracy, or the task's own metric."""
    if h.get("test_accuracy") is not None:
        return float(h["test_accuracy"])
    metric = h.get("test_metric")
    if isinstance(metric, dict):
        return float(metric["value"])
    return None if metric is None else float(metric)


def reference_accuracy(workdir: Path) -> float | None:
    """The best last-epoch test score among a run's candidates (its private journal): a
    non-private number for this benchmark's table, never a release."""
    from dptune._state.journal import Journal

    best = None
    with Journal(workdir / "private", readonly=True) as journal:
        for row in journal.candidates():
            if row.failed or row.score is None:
                continue
            history = journal.read_payload(row.index).get("history") or []
            scores = [v for v in map(_score, history) if v is not None]
            if scores and math.isfinite(scores[-1]):
                best = scores[-1] if best is None else max(best, scores[-1])
    return best


def task_trainer(task: str, arrays: tuple[np.ndarray, ...], defaults: dict, base: dict) -> Any:
    """``task``'s ``dptune.DpSgdTrainer`` on ``arrays`` (``Task.load``'s): the validation size of
    ``defaults``, the task's model, loss and metric (fine-tuning: ``base``'s shipped model under
    the public start ``defaults["init"]``), ``base`` its base hyperparameters."""
    import dptune

    t = TASKS[task]
    x, y, xt, yt = arrays
    n = len(x)  # the benchmark's own public size (the data are generated or public)
    v = int(defaults["data"]["validation_size"])
    data = dptune.Dataset.from_arrays(x, y, num_examples=n, validation_fraction=min(v / n, 0.2),
                                      x_test=xt, y_test=yt, num_classes=t.num_classes or None,
                                      name=f"tuning-value-{task}")  # fmt: skip
    kw: dict[str, Any] = {}
    if not t.finetune:
        kw["model"] = t.model(t.num_classes)
    else:
        kw["init"] = defaults["init"]
    if t.loss is not None:
        kw["loss"] = t.loss
    if t.metric is not None:
        kw["metric"] = dptune.Metric(t.metric[0], lo=0.0, hi=1.0, name=t.metric[1])
    return dptune.DpSgdTrainer(data, base, epoch_progress=False, **kw)


def run_one(task: str, arm: str, epsilon: float, args: argparse.Namespace) -> dict[str, Any]:
    import dptune

    t = TASKS[task]
    x, y, xt, yt = t.load(args.fashion_dir)
    if args.small:
        x, y = x[:1500], y[:1500]
    n = len(x)
    if arm == "dptune_before":
        defaults = defaults_before(n, t.finetune)
    else:
        defaults = finetune_defaults() if t.finetune else user_defaults(n)
    base, sp, selection = arm_setup(arm, defaults, args.small)
    trainer = task_trainer(task, (x, y, xt, yt), defaults, base)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dptune-tv-") as work:
        try:
            rel = dptune.tune(trainer, sp, selection, (epsilon, DELTA), workdir=work,
                              ledger=None, progress=False)  # fmt: skip
        except dptune.Refused as e:
            # e.g. best-of-k's composed budget leaves no noise multiplier: a user of this arm
            # gets no model at this epsilon, which the table counts as released nothing.
            return {"released": False, "test_accuracy": None, "reference": None, "hparams": None,
                    "total_epsilon": None, "refused": str(e),
                    "seconds": time.perf_counter() - t0}  # fmt: skip
        ref = reference_accuracy(Path(work)) if arm == "dptune" else None
    return {
        "released": bool(rel.released),
        "test_accuracy": _score(
            {"test_accuracy": rel.test_accuracy, "test_metric": rel.test_metric}
        )
        if rel.released
        else None,
        "reference": ref,
        "hparams": rel.hparams,
        "total_epsilon": rel.privacy.get("total_epsilon"),
        "seconds": time.perf_counter() - t0,
    }


# --- summary ------------------------------------------------------------------------------------


def summarise(rows: Sequence[dict[str, Any]], chance: dict[str, float]) -> dict:
    """(task, arm, epsilon) -> median, 10th and 90th percentile of released test accuracy (a run
    that released nothing counts as chance: a user without a model has a guess), runs, empties.
    The ``reference`` arm comes from the dptune runs' journals."""
    cells: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        for arm, value in ((r["arm"], r["test_accuracy"]), ("reference", r.get("reference"))):
            if arm == "reference" and r["arm"] != "dptune":
                continue
            cell = cells.setdefault((r["task"], arm, r["epsilon"]), {"acc": [], "empty": 0})
            if value is None:
                cell["empty"] += 1
                value = chance[r["task"]]
            cell["acc"].append(float(value))
    for cell in cells.values():
        a = np.asarray(cell["acc"])
        cell.update(n=len(a), median=float(np.median(a)), p10=float(np.percentile(a, 10)),
                    p90=float(np.percentile(a, 90)))  # fmt: skip
    return cells


def markdown_table(cells: dict, tasks: Sequence[str], epsilons: Sequence[float]) -> str:
    arms = [a for a in [*ARMS, "reference"] if any(k[1] == a for k in cells)]
    lines = ["| task | total epsilon | " + " | ".join(LABELS[a] for a in arms) + " |",
             "|---|---:|" + "---:|" * len(arms)]  # fmt: skip
    for task in tasks:
        for e in epsilons:
            row = []
            for a in arms:
                c = cells.get((task, a, e))
                if c is None:
                    row.append("not run")
                    continue
                empty = f", {c['empty']} released nothing" if c["empty"] else ""
                row.append(f"{100 * c['median']:.1f} [{100 * c['p10']:.1f}, "
                           f"{100 * c['p90']:.1f}] (n={c['n']}{empty})")  # fmt: skip
            lines.append(f"| {task} | {e:g} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(cells: dict, tasks: Sequence[str], epsilons: Sequence[float], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4 * len(tasks), 3.4))
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, task in zip(axes, tasks, strict=True):
        for i, a in enumerate(a for a in [*ARMS, "reference"] if any(k[1] == a for k in cells)):
            es = [e for e in epsilons if (task, a, e) in cells]
            med = np.array([cells[(task, a, e)]["median"] for e in es]) * 100
            lo = med - np.array([cells[(task, a, e)]["p10"] for e in es]) * 100
            hi = np.array([cells[(task, a, e)]["p90"] for e in es]) * 100 - med
            xs = np.array(es) * (1 + 0.03 * (i - 2))  # side by side, not on top of each other
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=LABELS[a],
                        linestyle="--" if a == "reference" else "-")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xticks(list(epsilons), [f"{e:g}" for e in epsilons])
        ax.set_xlabel("total epsilon (tuning included)")
        ax.set_title(task)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("released test accuracy (%): median, 10th-90th pct")
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument(
        "--arms", nargs="+", default=[a for a in ARMS if a != "dptune_before"], choices=ARMS
    )
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 3.0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fashion_dir", default="../shared/data/fashion-mnist")
    ap.add_argument("--small", action="store_true", help="1,500 records, 1 epoch: a quick look")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "tuning_value.json"
    meta = {"small": args.small, "delta": DELTA}
    rows: list[dict[str, Any]] = []
    if store.exists():  # resume: a finished run is never rerun (and never run twice)
        old = json.loads(store.read_text())
        if old["meta"] != meta:
            raise SystemExit(f"{store} holds runs of other settings ({old['meta']})")
        rows = old["runs"]
    done = {(r["task"], r["arm"], r["epsilon"], r["rep"]) for r in rows}
    # Repetition-major: an interrupted benchmark has every cell with fewer repetitions.
    for rep in range(args.reps):
        for task in args.tasks:
            for e in args.eps:
                for arm in args.arms:
                    if (task, arm, float(e), rep) in done:
                        continue
                    r = run_one(task, arm, float(e), args)
                    rows.append({"task": task, "arm": arm, "epsilon": float(e), "rep": rep, **r})
                    print(json.dumps(rows[-1], default=str), flush=True)
                    tmp = store.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"meta": meta, "runs": rows}, indent=1,
                                              default=str))  # fmt: skip
                    os.replace(tmp, store)
    # a run that released nothing scores as a guess: 1 / classes (1 / vocabulary for an LM)
    chance = {name: t.chance or 1.0 / t.num_classes for name, t in TASKS.items()}
    cells = summarise(rows, chance)
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    table = markdown_table(cells, tasks, [float(e) for e in args.eps])
    (out / "tuning_value.md").write_text(table)
    if tasks:
        plot(cells, tasks, [float(e) for e in args.eps], out / "tuning_value.png")
    print(table)
    return {"rows": rows, "cells": cells, "table": table}


if __name__ == "__main__":
    main()
