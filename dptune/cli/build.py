"""From a config (a ``ConfigDict`` or a dict) to the library's objects and a ``dptune.tune`` call:
the one place the CLI, ``--dry_run``, the Ray workers and the scripts do it. It checks only what a
config alone can get wrong (:class:`ConfigError` naming the field); the values it hands on are
checked by the library that receives them, in its words (``dptune.tuner.preflight``)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from dptune import learners, strategies
from dptune import space as space_mod
from dptune._state.workdir_lock import workdir_lock
from dptune.configs import base as base_config
from dptune.data import MNIST_10K_DIR, MNIST_10K_NUM_TRAIN
from dptune.errors import Refused, TuningConfigError
from dptune.executors import make_executor
from dptune.learners import dpsgd
from dptune.plan import AUTO, Budget
from dptune.subsampled import plan_subsampled, tune_subsampled
from dptune.tuner import DEFAULT_LEDGER, TuneOptions, preflight, tune
from selection import registry

log = logging.getLogger("dptune")


class ConfigError(Refused):
    """The config is malformed; nothing was loaded or trained."""


def _get(cfg: Mapping[str, Any], path: str, default: Any = None) -> Any:
    cur: Any = cfg
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return default
        cur = cur[part]
    return cur


def _section(cfg: Mapping[str, Any], path: str) -> dict[str, Any]:
    return dict(_get(cfg, path, {}) or {})


def build_selection(cfg: Mapping[str, Any]) -> Any:
    """The selection method named by ``config.selection`` (``selection.registry``'s vocabulary)."""
    s = _section(cfg, "selection")
    method = s.pop("method", None)
    options, unused = registry.applicable(method, s)
    if unused:
        log.info("config.selection: %s not used by method %r", unused, method)
    try:
        return registry.build(method, options)
    except registry.SelectionConfigError as e:
        where = f"config.selection.method={method!r}: "
        cmd = f"--{where}" + registry.options_as("--config.selection.", str(e))
        raise ConfigError(where + str(e), command=cmd) from None


def build_executor(cfg: Mapping[str, Any]) -> Any:
    """The executor named by ``config.executor`` (``dptune.executors``)."""
    ex = {k: v for k, v in _section(cfg, "executor").items() if v is not None}  # None: unset
    try:
        return make_executor(ex.pop("kind", "sequential"), **ex)
    except (TypeError, ValueError) as e:
        named = str(e).partition("=")[0] in ex  # a refused option, "option=..."
        cmd = getattr(e, "command", None) or (f"--config.executor.{e}" if named else None)
        raise ConfigError(f"config.executor: {e}", command=cmd) from None


def user_arrays(cfg: Mapping[str, Any]) -> str | None:
    """ "npz" or "loader" when ``config.data`` names the user's own arrays, else None."""
    if _get(cfg, "data.loader"):
        return "loader"
    return "npz" if _get(cfg, "data.source") == "npz" else None


def import_object(spec: Any, field: str) -> Any:
    """The callable named ``"pkg.module:attribute"`` (a user's factory or loader), importable from
    ``sys.path`` or the current folder (as ``python -m`` would find it)."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"config.{field}={spec!r} must be 'pkg.module:name'")
    module, attribute = spec.split(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj = importlib.import_module(module)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except SyntaxError as e:  # the user's module: its file and line, not a bug of dptune's
        raise ConfigError(
            f"config.{field}={spec!r}: module {module!r} has a syntax error at {e.filename}, line "
            f"{e.lineno}: {e.msg}; fix the module"
        ) from None
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"config.{field}={spec!r} cannot be imported: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while it was imported
        raise ConfigError(
            f"config.{field}={spec!r}: importing module {module!r} raised {type(e).__name__}: {e}"
        ) from None
    if not callable(obj):
        raise ConfigError(f"config.{field}={spec!r} is not callable")
    return obj


def _check_user_data(cfg: Mapping[str, Any], kind: str) -> None:
    if kind == "npz" and not _get(cfg, "data.path"):
        raise ConfigError("config.data.source='npz' needs config.data.path=<file.npz>")
    nex, vsize = _get(cfg, "data.num_examples"), _get(cfg, "data.validation_size", 5000)
    if isinstance(nex, bool) or not isinstance(nex, int) or nex < 1:
        raise ConfigError(
            f"config.data.num_examples is required for your own data (got {nex!r}): the public "
            "number of records in it, an integer >= 1 (sampling rates and step counts must not "
            "depend on the private arrays' length)"
        )
    if isinstance(vsize, int) and not vsize < nex:
        raise ConfigError(
            f"config.data.validation_size={vsize} must be smaller than config.data.num_examples="
            f"{nex} (it is the expected number of records in the validation split)"
        )
    if _get(cfg, "data.validation_dir") or _get(cfg, "data.validation_public"):
        raise ConfigError(
            "config.data.validation_dir / validation_public are for IDX datasets; with your own "
            "arrays, split them by record (config.data.validation_size) or use the library's "
            "public_validation"
        )
    ncl = _get(cfg, "data.num_classes")
    if ncl is not None and (isinstance(ncl, bool) or not isinstance(ncl, int) or ncl < 1):
        raise ConfigError(f"config.data.num_classes={ncl!r} must be a positive integer")


#: Sections whose keys are free: hyperparameters (checked against the trainer's own fields) and
#: the learner's own options (checked by ``dptune.learners.build``).
_FREE_SECTIONS = ("space", "train", "learner")


def _check_known_fields(
    node: Mapping[str, Any], schema: Mapping[str, Any] | None = None, prefix: str = ""
) -> None:
    """Every field of the config is one dptune reads (``dptune.configs.base`` declares them all):
    a misspelt field would otherwise be silently ignored and its default used."""
    schema = _plain(base_config.get_config()) if schema is None else schema
    for key, value in node.items():
        if str(key).startswith("_") or (not prefix and key in _FREE_SECTIONS):
            continue
        if key not in schema:
            close = difflib.get_close_matches(str(key), [str(k) for k in schema], n=1)
            hint = f" (did you mean config.{prefix}{close[0]}?)" if close else ""
            raise ConfigError(
                f"config.{prefix}{key} is not a field dptune knows{hint}; the fields of "
                f"config.{prefix.rstrip('.') or '<top>'} are: {', '.join(sorted(schema))}"
            )
        if isinstance(value, Mapping) and isinstance(schema[key], Mapping):
            _check_known_fields(value, schema[key], f"{prefix}{key}.")


def _coerce_fixed_numbers(cfg: dict[str, Any]) -> None:
    """``--config.space.noise_multiplier=1.1`` arrives as the string "1.1" (the field's default,
    "auto", is a string): a number written as text in ``config.space`` becomes that number. Other
    text stays text (a constant may be a name: ``space.model = "scatter_linear"``; the trainer
    checks it), except in ``noise_multiplier``, which can only be 'auto' or a number."""
    space = cfg.get("space")
    for key, value in list(space.items()) if isinstance(space, dict) else ():
        if isinstance(value, str) and value != AUTO:
            try:
                space[key] = float(value)
            except ValueError:
                if key == "noise_multiplier":
                    raise ConfigError(
                        f"config.space.{key}={value!r} must be {AUTO!r} (calibrated to the "
                        "budget), a number, or a distribution"
                    ) from None


def learner_sections(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config.train`` and ``config.space`` as ``config.trainer``'s learner takes them, so that
    ``--config.trainer=NAME`` works on any config: a field another learner knows is left out
    (logged; this learner's default fills it), a field no learner knows is refused (ConfigError).
    """
    info = learner_info(cfg)
    train, space = _section(cfg, "train"), _section(cfg, "space")
    own = _fields(info)
    if not (foreign := (set(train) | set(space)) - own):
        return train, space
    if unknown := foreign - set().union(*(_fields(i) for i in learners.LEARNERS.values())):
        raise ConfigError(
            f"unknown hyperparameters {sorted(unknown)} for config.trainer={info.name!r}: no "
            f"learner knows them; {info.name} knows {sorted(own)}"
        )
    log.info(
        "config.train / config.space: %s belong to another learner; config.trainer=%r uses its "
        "own defaults for them", sorted(foreign), info.name,
    )  # fmt: skip
    return tuple({k: v for k, v in d.items() if k in own} for d in (train, space))


def _fields(info: learners.LearnerInfo) -> set[str]:
    """The hyperparameters a learner takes: its class's fields and its extra ones (LoRA's)."""
    trainer_cls = info.trainer_class()
    fields = set(trainer_cls.hyperparams_class.__dataclass_fields__)
    return fields | set(getattr(trainer_cls, "extra_hyperparams", ()))


def learner_info(cfg: Mapping[str, Any]) -> learners.LearnerInfo:
    """The candidate family of ``config.trainer`` (``dptune.learners.LEARNERS``; default DP-SGD)."""
    try:
        return learners.get(_get(cfg, "trainer", "dpsgd"))
    except ValueError as e:
        raise ConfigError(f"config.trainer: {e}") from None


@dataclasses.dataclass(frozen=True)
class Checked:
    """A config that passed :func:`validate`, as the library's arguments."""

    cfg: dict[str, Any]
    method: Any
    space: Any
    budget: Budget
    options: TuneOptions


def validate(
    cfg: Any, workdir: str | Path | None = None, *, seed: int | None = None,
    debug_nonprivate: bool = False,
) -> Checked:  # fmt: skip
    """The checks of a run that need neither data nor files, shared by the run and ``--dry_run``:
    the config's fields (what only a config can get wrong: ConfigError naming the field), the
    selection, the space, the budget and the run's options (``TuneOptions.check``);
    ConfigError / TuningConfigError / StateError."""
    cfg = _plain(cfg)
    if isinstance(cfg, dict):
        _coerce_fixed_numbers(cfg)
        _fill_suggested(cfg)
    if not isinstance(cfg, Mapping):
        raise ConfigError(
            f"the config's get_config() returned {type(cfg).__name__}, not a ConfigDict or dict: "
            "start from dptune.configs.base.get_config()"
        )
    _check_known_fields(cfg)
    if kind := user_arrays(cfg):
        _check_user_data(cfg, kind)
    trainer, model = _get(cfg, "trainer", "dpsgd"), _get(cfg, "model")
    info, own = learner_info(cfg), _section(cfg, "learner")  # its options without a default:
    needed = inspect.signature(info.trainer_class()).parameters.values()  # given, or refused
    if unset := [p.name for p in needed if p.default is p.empty and p.name in info.options
                 and own.get(p.name) is None]:  # fmt: skip
        raise ConfigError(f"config.trainer={trainer!r} needs --config.learner.{unset[0]}=N")
    if _get(cfg, "init") and trainer != "dpsgd":
        # a section of the config that belongs to another learner (learner_sections' rule)
        log.info("config.init is DP-SGD's pretrained start: config.trainer=%r does not use it",
                 trainer)  # fmt: skip
    if model is not None and trainer != "dpsgd":
        raise ConfigError("config.model is a DP-SGD model: it needs config.trainer='dpsgd'")
    if model is not None and ":" not in str(model) and model not in dpsgd.MODEL_NAMES:
        raise ConfigError(
            f"config.model={model!r} must be 'pkg.module:factory' (your Flax module) or a "
            f"shipped model, one of {dpsgd.MODEL_NAMES}"
        )
    strategy = _section(cfg, "strategy")
    name = strategy.pop("name", "full")
    strategies.check(name, strategy, _get(cfg, "privacy.epsilon"))
    if name == "subsampled" and _get(cfg, "executor.kind") == "ray":
        raise ConfigError(
            "config.executor.kind='ray' is not supported with config.strategy.name='subsampled' "
            "(the workers would load all the data, not the subset): use 'sequential', "
            "'vectorized' or 'devices'"
        )
    build_executor(cfg)
    vsize = _get(cfg, "data.validation_size", 5000)
    if isinstance(vsize, bool) or not isinstance(vsize, int) or vsize < 1:
        raise ConfigError(f"config.data.validation_size={vsize!r} must be an integer >= 1")
    if overlap := set(_section(cfg, "train")) & set(_section(cfg, "space")):
        raise ConfigError(f"{sorted(overlap)} are in both config.train and config.space; keep one")
    budget = Budget(_get(cfg, "privacy.epsilon"), _get(cfg, "privacy.delta"))
    cfg["train"], cfg["space"] = learner_sections(cfg)
    method = build_selection(cfg)
    space = space_mod.Space.from_config(cfg["space"])
    ledger_cfg = _section(cfg, "ledger")
    enabled = ledger_cfg.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"config.ledger.enabled={enabled!r} must be True or False")
    # the dataset's lifetime budget (None: not stated; an epsilon alone takes this run's delta)
    eps, delta = ledger_cfg.get("budget_epsilon"), ledger_cfg.get("budget_delta")
    try:
        stated = None if eps is None else Budget(eps, budget.delta if delta is None else delta)
    except TuningConfigError as e:  # named as the config's fields, not as the run's budget
        raise ConfigError(f"config.ledger.budget_epsilon / budget_delta: {e}") from None
    options = TuneOptions(
        workdir=workdir, seed=seed, debug_nonprivate=debug_nonprivate,
        ledger=(ledger_cfg.get("path") or DEFAULT_LEDGER) if enabled else None,
        dataset_budget=stated,
        accountant=_get(cfg, "privacy.accountant", "auto"),
        adjacency=_get(cfg, "privacy.adjacency", "add_remove"),
    )  # fmt: skip
    options.check()
    return Checked(cfg, method, space, budget, options)


def _fill_suggested(cfg: dict[str, Any]) -> None:
    """Fills the fields a config leaves None (the ``user`` config's) from the declared PUBLIC size
    ``config.data.num_examples`` and the optimiser (``dpsgd.suggested_settings``)."""
    data, train, sel = (cfg.get(k) or {} for k in ("data", "train", "selection"))
    lr = (cfg.get("space") or {}).get("learning_rate")
    lr = lr if isinstance(lr, dict) else {}  # a range whose ends are None; other specs as given
    slots = [(data, "validation_size"), (train, "batch_size"), (train, "epochs"),
             (sel, "mean_trials"), (lr, "low"), (lr, "high")]  # fmt: skip
    unset = [(section, key) for section, key in slots if key in section and section[key] is None]
    n, optimizer = data.get("num_examples"), train.get("optimizer", "momentum")
    usable = isinstance(n, int) and not isinstance(n, bool) and n >= 8
    if not unset or not usable or optimizer not in dpsgd.LEARNING_RATE_RANGES:
        return  # nothing to fill, or a size or optimiser the checks or the learner name
    got = dpsgd.suggested_settings(n, optimizer, train.get("score_noise_std") or 0.0)
    got["low"], got["high"] = got["learning_rate"]
    batch = train.get("batch_size")
    if optimizer != "adam" and isinstance(batch, int) and not isinstance(batch, bool) and batch > 0:
        # SGD's range is per record of the batch the run uses: the user's (public), where given
        got["low"], got["high"] = (v * batch for v in dpsgd.LEARNING_RATE_RANGES[optimizer])
    for section, key in unset:
        section[key] = got[key]
    filled = {("learning_rate_" if s is lr else "") + k: got[k] for s, k in unset}
    log.info("derived from config.data.num_examples=%d and optimizer %r (public): %s", n,
             optimizer, filled)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DryRun:
    """What ``--dry_run`` found: the calibrated space, the statement and the preflight."""

    space: Any
    statement: Any
    preflight: Any = None  # None: a strategy with its own plan (config.strategy)

    def to_text(self) -> str:
        text = f"Dry run (nothing trained). Search space: {self.space.to_dict()}\n\n"
        text += self.statement.to_text()
        if (pre := self.preflight) is None:
            return text
        if pre.ledger is None:
            return text + "\n\nLedger: none (config.ledger.enabled=False): charged nowhere."
        s = pre.spend
        budget = f"(epsilon={s.budget_epsilon:g}, delta={s.budget_delta:g})"
        what = "the budget this run states" if pre.dataset_budget is not None else "the default"
        how = (f"has no lifetime budget yet; the run would register {what} {budget}"
               if s.registered else f"has the lifetime budget {budget}")  # fmt: skip
        return text + (
            f"\n\nLedger {pre.ledger}: dataset {pre.fingerprint} {how}; after this run it would "
            f"have spent epsilon={s.spent_epsilon:.4g}. Set a budget with `dptune ledger "
            f"--dataset={pre.fingerprint[:12]} --budget_epsilon=E --budget_delta=D` or "
            "--config.ledger.budget_epsilon / budget_delta."
        )


def run_config(
    cfg: Mapping[str, Any], workdir: str | Path, *, seed: int | None = None,
    debug_nonprivate: bool = False, progress: bool = True, dry_run: bool = False,
) -> Any:  # fmt: skip
    """Runs one tuning job from a config (what the command does after parsing flags); with
    ``dry_run``, a :class:`DryRun` after the run's checks (``dptune.tuner.preflight``), nothing
    trained or written."""
    checked = validate(cfg, workdir, seed=seed, debug_nonprivate=debug_nonprivate)
    cfg, opts = checked.cfg, checked.options
    executor = None if dry_run else build_executor(cfg)
    try:
        if not dry_run:
            # Ray: reach the cluster and check its resources before any data is loaded or trained.
            if hasattr(executor, "connect"):
                executor.connect()
            # A workdir in use is refused before the (slow) data loading, not a minute later;
            # tune() then holds the lock for the whole run (dptune/_state/workdir_lock.py).
            with workdir_lock(opts.workdir):
                pass
        trainer = build_trainer(cfg, load_data(cfg), progress=progress)
        if hasattr(executor, "connect"):
            # Workers rebuild the trainer from the config (each loads the data once) and check they
            # loaded the same records as this process.
            trainer.remote_factory = functools.partial(trainer_from_config, _worker_config(cfg))
            executor.expected_fingerprint = trainer.fingerprint
        # What the journal binds the workdir to: the config without file locations (a workdir moved
        # to another machine resumes), the records' fingerprint, and the flags that change the run.
        bound = _plain(cfg)
        for section, key in (("data", "dir"), ("data", "validation_dir"), ("ledger", "path")):
            if isinstance(bound.get(section), dict):
                bound[section].pop(key, None)
        bound["_data"] = {"fingerprint": getattr(trainer, "fingerprint", None)}
        bound["_flags"] = {"seed": opts.seed, "debug_nonprivate": opts.debug_nonprivate}
        opts = dataclasses.replace(opts, config=bound, executor=executor, progress=progress)
        args = (trainer, checked.space, checked.method, checked.budget)
        strategy = _section(cfg, "strategy")
        if strategy.get("name", "full") == "subsampled":
            if opts.debug_nonprivate:
                raise ConfigError("--debug_nonprivate is not supported with config.strategy.name="
                                  "'subsampled'")  # fmt: skip
            kw = {k: float(strategy[k]) for k in ("fraction", "tuning_epsilon")}
            if dry_run:
                seeded, acc, adj = opts.seed is not None, opts.accountant, opts.adjacency
                plan = plan_subsampled(*args, **kw, seeded=seeded, accountant=acc, adjacency=adj)
                return DryRun(_filled(plan.tuning_plan.space, plan.calibrated), plan.statement)
            return tune_subsampled(*args, **kw, options=opts)
        if dry_run:
            pre = preflight(*args, opts)
            return DryRun(_filled(pre.plan.space, pre.plan.calibrated), pre.plan.statement, pre)
        return tune(*args, opts)
    finally:
        # Frees what the executor put in Ray and shuts down a local Ray this run started, also
        # when a refusal (workdir in use, data not found, budget) comes before training.
        if hasattr(executor, "close"):
            executor.close()


def _filled(space: Any, calibrated: Mapping[str, Any]) -> space_mod.Space:
    return space_mod.Space({**space.to_dict(), **calibrated})


def build_trainer(cfg: Mapping[str, Any], data: Any, *, progress: bool = False) -> Any:
    """The trainer of ``config.trainer`` (default ``"dpsgd"``) on ``data``, with ``config.train``
    as its fixed hyperparameters and ``config.learner`` as its own options."""
    info = learner_info(cfg)
    options = {k: v for k, v in _section(cfg, "learner").items() if v is not None}
    base = _section(cfg, "train")
    if info.name == "dpsgd":
        options["epoch_progress"] = progress
        model = cfg.get("model")
        if model is not None:
            base.pop("model", None)  # config.model replaces config.train.model
            built = model  # a shipped name, or "pkg.module:factory" called as below
            if ":" in model:  # num_classes is 0 for labels that are not class ids
                factory = import_object(model, "model")
                try:
                    built = factory(num_classes=data.num_classes)
                except Exception as e:  # the user's code: one line naming the field
                    raise ConfigError(
                        f"config.model={model!r}: factory(num_classes={data.num_classes}) failed: "
                        f"{type(e).__name__}: {e}"
                    ) from None
            # a factory may return {"model": module, "loss": fn, "metric": dptune.Metric}: the
            # route for labels the default loss and accuracy do not read (float, (n, k), (n, L))
            parts = built if isinstance(built, Mapping) else {"model": built}
            if ":" in model and data.num_classes == 0 and "loss" not in parts:
                # refused before the module's init, which a head of 0 classes may crash
                raise ConfigError(
                    f"config.model={model!r}: the labels of config.data are not class ids (float "
                    "or more than one per record: num_classes=0), which the default loss "
                    "(softmax cross-entropy) cannot train: make the factory return {'model': "
                    "module, 'loss': fn(outputs, labels) -> (b,) per-example losses, 'metric': "
                    "dptune.Metric(fn, lo, hi)} (docs/your_model.md), or give integer class labels"
                )
            options.update({k: parts[k] for k in ("model", "loss", "metric") if k in parts})
        if cfg.get("init"):  # '' is no init: --config.init='' turns a config's start off
            options["init"] = cfg["init"]
    try:
        return learners.build(info.name, data, base, **options)
    except ValueError as e:
        msg = str(e).removeprefix("dptune: ")  # the command's refusal line has its own
        where = "config." if msg.startswith(("init=", "model")) else "config.learner."
        raise ConfigError(f"{where}{msg}") from None


def _worker_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What a worker needs to rebuild the trainer (the data spec, the learner and its fixed
    settings), copied one level deep."""
    keys = ("data", "train", "trainer", "learner", "model", "init")
    return {k: (dict(cfg[k]) if isinstance(cfg[k], Mapping) else cfg[k]) for k in keys if k in cfg}


def trainer_from_config(cfg: Mapping[str, Any]) -> Any:
    """The trainer of ``cfg``, data loaded, no progress: what a Ray worker builds once."""
    return build_trainer(cfg, load_data(cfg), progress=False)


def load_user_arrays(cfg: Mapping[str, Any]) -> Any:
    """``config.data`` as the user's own arrays (an npz file or a loader's), through
    ``Dataset.from_arrays`` with the declared public size."""
    d, kind = cfg["data"], user_arrays(cfg)
    try:
        if kind == "npz":
            path = Path(d["path"]).expanduser()
            with open(path, "rb") if path.is_file() else nullcontext() as f:
                head = f.read(4) if f else b"PK"  # read_npz names a missing file
            if not head.startswith(b"PK"):  # numpy would take it for a pickle (allow_pickle)
                raise ConfigError(
                    f"config.data.path={str(path)!r} is not an npz file (numpy.savez writes a zip "
                    f"archive; this file starts with {head!r}): save your arrays with "
                    "numpy.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)"
                )
            arrays = dpsgd.read_npz(path)
        else:
            out = import_object(d["loader"], "data.loader")()
            if isinstance(out, Mapping):
                arrays = dict(out)
            elif isinstance(out, (tuple, list)) and len(out) in (2, 4):
                arrays = dict(zip(("x_train", "y_train", "x_test", "y_test"), out, strict=False))
            else:
                raise ValueError(
                    "the loader must return a dict with keys x_train, y_train (x_test, y_test) or "
                    "a tuple (x_train, y_train[, x_test, y_test])"
                )
            arrays = dpsgd.check_user_arrays(arrays, f"config.data.loader={d['loader']!r}")
        num = int(d["num_examples"])
        return dpsgd.Dataset.from_arrays(
            arrays["x_train"], arrays["y_train"], num_examples=num,
            validation_fraction=int(d.get("validation_size", 5000)) / num,
            x_test=arrays.get("x_test"), y_test=arrays.get("y_test"),
            num_classes=d.get("num_classes"), name=str(d.get("name") or kind),
            seed_split=int(d.get("split_seed") or 0),
        )  # fmt: skip
    except ConfigError:
        raise
    except dpsgd.DatasetNotFoundError as e:
        raise ConfigError(f"config.data: {_words(e)}") from None
    except Exception as e:  # a user's loader or file: one line naming the field
        raise ConfigError(f"config.data ({kind}): {type(e).__name__}: {_words(e)}") from None


#: The data loader's keywords, as its message names them, and the command's fields for them.
_DATA_KEYWORDS = {
    "data_dir=<folder>": "--config.data.dir=<folder>", "source='idx'": "--config.data.source=idx",
    "source='cifar_pickle'": "--config.data.source=cifar_pickle",
    "Dataset.from_arrays needs num_classes=...": "it needs --config.data.num_classes=K",
}  # fmt: skip


def _words(e: Exception) -> str:
    """The data loader's message with its keywords as ``--config.data`` fields."""
    return functools.reduce(lambda text, kv: text.replace(*kv), _DATA_KEYWORDS.items(), str(e))


def load_data(cfg: Mapping[str, Any]) -> Any:
    """Loads ``config.data`` (public work: reading files is not a private computation)."""
    if user_arrays(cfg) is not None:
        return load_user_arrays(cfg)
    d = cfg["data"]
    data_dir, num_examples = d.get("dir") or None, d.get("num_examples")
    if data_dir == "<shipped:mnist-10k>":
        data_dir, num_examples = str(MNIST_10K_DIR), num_examples or MNIST_10K_NUM_TRAIN
    try:
        return dpsgd.load_dataset(
            d["name"], data_dir=data_dir, validation_size=int(d.get("validation_size", 5000)),
            source=d.get("source", "auto"), seed_split=int(d.get("split_seed") or 0),
            num_examples=num_examples, validation_dir=d.get("validation_dir") or None,
            validation_public=bool(d.get("validation_public", False)),
        )  # fmt: skip
    except dpsgd.DatasetNotFoundError as e:
        raise ConfigError(f"config.data: {_words(e)}") from None
    except (ValueError, OSError, EOFError) as e:
        raise ConfigError(f"config.data ({d['name']!r} from {data_dir!r}): {e}") from None


def _plain(cfg: Any) -> Any:
    """``cfg`` (a ConfigDict, or a dict holding them) as plain dicts and lists, copied."""
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if isinstance(cfg, Mapping):
        return {k: _plain(v) for k, v in cfg.items()}
    if isinstance(cfg, list):
        return [_plain(v) for v in cfg]
    return cfg
