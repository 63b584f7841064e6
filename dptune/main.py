"""The ``dptune`` command: one private tuning run from a config file.

    dptune --config=smoke --workdir=/tmp/dptune-smoke
    dptune --config=fashion_mnist --workdir=runs/fmnist \\
        --config.data.dir=/data/fashion-mnist --config.selection.mean_trials=8
    python -m dptune.main --config=configs/smoke.py --workdir=/tmp/dptune-smoke  # a config file

``--config`` takes a shipped config's name (smoke, mnist, fashion_mnist, cifar10) or a path to a
config file; ``--config.<field>=<value>`` overrides any field.

Everything is checked before anything private runs: the config, the data, the budget (the noise
multiplier is calibrated so the *total* epsilon, tuning included, meets it) and the dataset's
ledger. Rerunning the same command with the same ``--workdir`` resumes a killed run (same plan,
same seeds, finished candidates kept); a different config with that workdir is refused.

What the console shows: a progress display with elapsed time and epochs of the candidate being
trained, never the number of candidates or any score (the console may be the curator's, but logs
get shared). ``DIR/release/`` is what may be published; ``DIR/private/`` is the curator's.
``--debug_nonprivate`` prints every score and K and marks the statement NOT private.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A shipped config (smoke, mnist, fashion_mnist, cifar10) or a config file."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder: private/ (journal) and release/.")
_SEED = flags.DEFINE_integer(
    "seed", None, "Fixed seed (debugging); default OS entropy. The guarantee then needs it secret."
)
_DEBUG = flags.DEFINE_bool(
    "debug_nonprivate", False, "Print every candidate's score and K; the run is then NOT private."
)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress display on stderr.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Only check the config and data and print the privacy plan; train nothing."
)

log = logging.getLogger("dptune")

DATASETS = ("mnist", "fashion_mnist", "cifar10", "synthetic")


class ConfigError(ValueError):
    """The config is malformed; nothing was loaded or trained."""


def _get(cfg: Mapping[str, Any], path: str, default: Any = None) -> Any:
    cur: Any = cfg
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return default
        cur = cur[part]
    return cur


def _number(cfg: Mapping[str, Any], path: str, *, positive: bool = True) -> float:
    x = _get(cfg, path)
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ConfigError(f"config.{path}={x!r} must be a finite number")
    if positive and x <= 0:
        raise ConfigError(f"config.{path}={x!r} must be > 0")
    return float(x)


def build_selection(cfg: Mapping[str, Any]) -> Any:
    """The selection method named by ``config.selection`` (``selection.registry``'s vocabulary)."""
    from selection import registry

    s = _get(cfg, "selection")
    if not isinstance(s, Mapping) or "method" not in s:
        raise ConfigError(
            "config.selection.method is missing; choose one of " + ", ".join(registry.names())
        )
    if s["method"] not in registry.names():
        raise ConfigError(
            f"config.selection.method={s['method']!r} is unknown; choose one of "
            + ", ".join(registry.names())
        )
    options, unused = registry.applicable(
        s["method"], {k: v for k, v in s.items() if k != "method"}
    )
    if unused:
        log.info("config.selection: %s not used by method %r", unused, s["method"])
    try:
        return registry.build(s["method"], options)
    except registry.SelectionConfigError as e:
        raise ConfigError(f"config.selection: {e}") from None


def build_executor(cfg: Mapping[str, Any]) -> Any:
    """The executor named by ``config.executor`` (``dptune.executors``)."""
    from dptune.executors import make_executor

    ex = dict(_get(cfg, "executor", {}) or {})
    kind = ex.pop("kind", "sequential")
    group = ex.pop("group_size", 1)
    try:
        return make_executor(
            kind, group_size=group, **{k: v for k, v in ex.items() if v is not None}
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.executor: {e}") from None


def check_config(cfg: Mapping[str, Any]) -> None:
    """Cheap checks of everything that needs no data (raises ConfigError naming the value)."""
    name = _get(cfg, "data.name")
    if name not in DATASETS:
        raise ConfigError(
            f"config.data.name={name!r} is not a known dataset; use one of {DATASETS}"
        )
    eps = _number(cfg, "privacy.epsilon")
    delta = _number(cfg, "privacy.delta")
    if not delta < 1:
        raise ConfigError(f"config.privacy.delta={delta:g} must be < 1 (and below 1/n)")
    budget_eps = _get(cfg, "ledger.budget_epsilon")
    if budget_eps is not None and _number(cfg, "ledger.budget_epsilon") < eps:
        raise ConfigError(
            f"config.ledger.budget_epsilon={budget_eps:g} is below this run's epsilon={eps:g}: "
            "the run could never fit the dataset's budget"
        )
    budget_delta = _get(cfg, "ledger.budget_delta")
    if budget_delta is not None and _number(cfg, "ledger.budget_delta") < delta:
        raise ConfigError(
            f"config.ledger.budget_delta={budget_delta:g} is below this run's delta={delta:g}"
        )
    acc = _get(cfg, "privacy.accountant", "auto")
    if acc not in ("auto", "rdp", "pld"):
        raise ConfigError(f"config.privacy.accountant={acc!r} must be 'auto', 'rdp' or 'pld'")
    adj = _get(cfg, "privacy.adjacency", "add_remove")
    if adj not in ("add_remove", "replace_one"):
        raise ConfigError(f"config.privacy.adjacency={adj!r} must be 'add_remove' or 'replace_one'")
    nex = _get(cfg, "data.num_examples")
    if nex is not None and (isinstance(nex, bool) or not isinstance(nex, int) or nex < 1):
        raise ConfigError(
            f"config.data.num_examples={nex!r} must be a positive integer (the public number of "
            "records in the training file)"
        )
    vpub = _get(cfg, "data.validation_public", False)
    if not isinstance(vpub, bool):
        raise ConfigError(f"config.data.validation_public={vpub!r} must be True or False")
    if vpub and not _get(cfg, "data.validation_dir"):
        raise ConfigError(
            "config.data.validation_public=True needs a separate validation set "
            "(config.data.validation_dir): a split of the private training file is private"
        )
    group = _get(cfg, "executor.group_size", 1)
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ConfigError(f"config.executor.group_size={group!r} must be an integer >= 1")
    build_executor(cfg)
    vsize = _get(cfg, "data.validation_size", 5000)
    if isinstance(vsize, bool) or not isinstance(vsize, int) or vsize < 1:
        raise ConfigError(f"config.data.validation_size={vsize!r} must be an integer >= 1")
    space = _get(cfg, "space")
    if not isinstance(space, Mapping) or not space:
        raise ConfigError("config.space is empty: declare the hyperparameters to search")
    train = _get(cfg, "train", {})
    overlap = set(train) & set(space)
    if overlap:
        raise ConfigError(
            f"{sorted(overlap)} appear in both config.train and config.space; keep one"
        )
    from dptune.dpsgd import Hyperparams

    known = {f for f in Hyperparams.__dataclass_fields__}
    unknown = (set(train) | set(space)) - known
    if unknown:
        raise ConfigError(
            f"unknown hyperparameters {sorted(unknown)}; DP-SGD knows {sorted(known)}"
        )


def run_config(
    cfg: Mapping[str, Any],
    workdir: str | Path,
    *,
    seed: int | None = None,
    debug_nonprivate: bool = False,
    progress: bool = True,
    dry_run: bool = False,
) -> Any:
    """Runs one tuning job from a config dict (what the command does after parsing flags).

    With ``dry_run`` it returns ``(space, statement)`` from ``dptune.plan_privacy`` instead:
    checks and accounting only (public computations), no journal, no ledger, no training.
    """
    from dptune import space as space_mod
    from dptune.dpsgd import DpSgdTrainer
    from dptune.plan import Budget, plan_privacy
    from dptune.tuner import TuningConfigError, tune

    cfg = _plain(cfg)
    check_config(cfg)
    method = build_selection(cfg)
    try:
        space = space_mod.Space.from_config(cfg["space"])
        budget = Budget(_number(cfg, "privacy.epsilon"), _number(cfg, "privacy.delta"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not dry_run:
        # A workdir in use is refused before the (slow) data loading, not a minute later;
        # tune() then holds the lock for the whole run (dptune/workdir_lock.py).
        from dptune.workdir_lock import workdir_lock

        with workdir_lock(workdir):
            pass
    data = load_data(cfg)
    trainer = DpSgdTrainer(data, cfg.get("train", {}), epoch_progress=progress)
    if dry_run:
        return plan_privacy(
            trainer,
            space,
            method,
            budget,
            accountant=str(_get(cfg, "privacy.accountant", "auto")),
            seeded=seed is not None,
            debug_nonprivate=debug_nonprivate,
            adjacency=str(_get(cfg, "privacy.adjacency", "add_remove")),
        )
    ledger_cfg = cfg.get("ledger", {}) or {}
    ledger_path = ledger_cfg.get("path") or None
    if ledger_path is None and ledger_cfg.get("enabled", True):
        from dptune.ledger import default_ledger_path

        ledger_path = default_ledger_path()
    dataset_budget = None
    if ledger_cfg.get("budget_epsilon") is not None:
        dataset_budget = Budget(
            float(ledger_cfg["budget_epsilon"]),
            float(ledger_cfg.get("budget_delta") or budget.delta),
        )
    bound = dict(cfg)
    bound["_flags"] = {"seed": seed, "debug_nonprivate": debug_nonprivate}
    try:
        return tune(
            trainer,
            space,
            method,
            budget,
            workdir=workdir,
            seed=seed,
            executor=build_executor(cfg),
            accountant=str(_get(cfg, "privacy.accountant", "auto")),
            ledger=ledger_path if ledger_cfg.get("enabled", True) else None,
            dataset_budget=dataset_budget,
            config=bound,
            progress=progress,
            debug_nonprivate=debug_nonprivate,
            adjacency=str(_get(cfg, "privacy.adjacency", "add_remove")),
        )
    except TuningConfigError:
        raise


def load_data(cfg: Mapping[str, Any]) -> Any:
    """Loads ``config.data`` (public work: reading files is not a private computation)."""
    from dptune.dpsgd import DatasetNotFoundError, load_dataset

    d = cfg["data"]
    data_dir = d.get("dir") or None
    num_examples = d.get("num_examples")
    if data_dir == "<shipped:mnist-10k>":
        from dptune.data import MNIST_10K_DIR, MNIST_10K_NUM_TRAIN

        data_dir = str(MNIST_10K_DIR)
        num_examples = num_examples or MNIST_10K_NUM_TRAIN
    try:
        return load_dataset(
            d["name"],
            data_dir=data_dir,
            validation_size=int(d.get("validation_size", 5000)),
            source=d.get("source", "auto"),
            seed_split=int(d.get("split_seed") or 0),
            num_examples=num_examples,
            validation_dir=d.get("validation_dir") or None,
            validation_public=bool(d.get("validation_public", False)),
        )
    except DatasetNotFoundError as e:
        raise ConfigError(f"config.data: {e}") from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"config.data ({d['name']!r} from {data_dir!r}): {e}") from None


def _plain(cfg: Any) -> Any:
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if isinstance(cfg, Mapping):
        return {k: _plain(v) for k, v in cfg.items()}
    if isinstance(cfg, list):
        return [_plain(v) for v in cfg]
    return cfg


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config=configs/<name>.py is required")
    if not _WORKDIR.value:
        raise app.UsageError("--workdir=DIR is required (private/ and release/ go there)")
    from dptune.journal import ConfigChangedError
    from dptune.ledger import BudgetExceededError, LedgerBudgetMismatchError
    from dptune.space import SpaceError
    from dptune.tuner import TuningConfigError
    from dptune.workdir_lock import WorkdirLockedError

    _setup_logging()
    try:
        release = run_config(
            _CONFIG.value,
            _WORKDIR.value,
            seed=_SEED.value,
            debug_nonprivate=_DEBUG.value,
            progress=_PROGRESS.value,
            dry_run=_DRY_RUN.value,
        )
    except (
        ConfigError,
        SpaceError,
        TuningConfigError,
        BudgetExceededError,
        LedgerBudgetMismatchError,
        ConfigChangedError,
        WorkdirLockedError,
    ) as e:
        print(f"dptune: refused: {e}", file=sys.stderr)
        return 2
    if _DRY_RUN.value:
        space, statement = release
        print(f"Dry run (nothing trained). Search space: {space.to_dict()}\n")
        print(statement.to_text())
        return 0
    print(str(release))
    print(f"\nRelease folder: {Path(_WORKDIR.value) / 'release'}")
    return 0


def _setup_logging() -> None:
    """dptune's own messages at INFO on stderr; library chatter (orbax, dp_accounting's
    convergence warnings during calibration) only at ERROR."""
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dptune: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _resolve_config_names(argv: list[str]) -> list[str]:
    """``--config=NAME`` (a shipped config: smoke, mnist, fashion_mnist, cifar10) -> its file, so
    the command works outside a checkout; paths are left alone."""
    from dptune import configs

    out = []
    for arg in argv:
        if arg.startswith("--config="):
            value = arg[len("--config=") :]
            name, sep, rest = value.partition(":")
            if name in configs.NAMES and not Path(name).exists():
                arg = f"--config={configs.path_of(name)}{sep}{rest}"
        out.append(arg)
    return out


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with every bad flag or config override reported in one line (exit 2)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"dptune: refused: {e}", file=sys.stderr)
        sys.exit(2)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        # ml_collections raises these for an override of a field the config does not have
        overrides = [a.split("=")[0] for a in argv if a.startswith("--config.")]
        print(
            f"dptune: refused: a config override names a field the config does not have or "
            f"gives it a value of the wrong type ({type(e).__name__}: {e}); overrides given: "
            f"{overrides}",
            file=sys.stderr,
        )
        sys.exit(2)


def run() -> None:
    """Console-script entry point (``dptune``)."""
    from selection import registry

    sys.argv = _resolve_config_names(sys.argv)
    # `dptune --help` documents this module's flags (absl shows the main module's key flags, and
    # the console script's main module is the script, not this file).
    for name in ("config", "workdir", "seed", "debug_nonprivate", "progress", "dry_run"):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])
    main_module = sys.modules["__main__"]
    main_module.__doc__ = (__doc__ or "") + "\n" + registry.describe() + "\n"
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
