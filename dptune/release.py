"""What a tuning run releases, and the ``DIR/release/`` folder that holds it.

The release is the selected candidate only: its hyperparameters, its model, its (noisy) validation
score, its test accuracy and the privacy statement. Nothing about the other candidates is released,
not even how many there were: the selection theorems (Liu & Talwar 2019; Papernot & Steinke 2022)
cover the selected output alone, and revealing K would turn random stopping back into best-of-K.

Its files are ``RELEASE_FILES`` (docs/tuning.md). The folder is written to ``release.tmp/``
(fsynced) and renamed into place: it is complete or absent, whatever moment the process is killed
at, and a rerun of a killed run writes it again (``tests/dptune/test_release.py``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dptune import plots
from dptune.errors import StateError, TuningConfigError
from dptune.report import num, report_markdown

log = logging.getLogger("dptune")

RESULT_FILE = "result.json"
PRIVACY_JSON = "privacy.json"
PRIVACY_TXT = "privacy.txt"

#: ``Release.outcome`` values: a candidate was released; the selection chose none (a legitimate
#: private answer); the selected candidate failed (every candidate failed: no model released).
RELEASED = "released"
NONE_SELECTED = "none_selected"
NO_CANDIDATE_SUCCEEDED = "no_candidate_succeeded"

# The release whitelist: every file a release folder may hold and every key its JSON
# files may hold. ``write_release`` refuses anything else, and tests/release_whitelist.py
# holds a literal copy, so that a key is added only by someone who checked that the theorem
# covers it. What of the selected candidate appears is further limited by the selection method
# (``SelectionMethod.publishes``: ``validation_score`` only where the theorem covers the score).

#: Files (and the ``checkpoint/`` folder) of a release.
RELEASE_FILES = frozenset(
    {
        RESULT_FILE, PRIVACY_JSON, PRIVACY_TXT, "report.md", "epsilon.png",
        "training_curve.json", "training_curve.png", "payload.pkl", "checkpoint",
    }
)  # fmt: skip
#: Keys of ``result.json``.
RESULT_KEYS = frozenset(
    {"released", "hparams", "validation_score", "test_accuracy", "test_metric", "reason"}
)  # "reason" (of released: false): a function of the selected output alone (none selected, or
#    the selected candidate failed, which the selections' order makes "every one failed").
#    "test_metric" (a model scored by its own metric): that metric of the released model on the
#    public test split, as test_accuracy is accuracy's: post-processing of the released model.
#: Keys of ``privacy.json`` (the statement, the budget and Accuracy First's ex-post loss).
PRIVACY_KEYS = frozenset(
    {
        "total_epsilon", "delta", "single_run_epsilon", "single_run_delta", "overhead", "method",
        "theorem", "accountant", "route", "rdp_order", "seeded", "private", "adjacency", "notes",
        "selection", "candidates", "budget_epsilon", "budget_delta", "ex_post_epsilon",
        "assumptions", "checked", "trainer_word", "published",
    }
)  # fmt: skip
#: Keys of a ``training_curve.json`` row, besides metrics named ``test_*`` (public test split) and
#: ``noisy_*`` (privatised).
CURVE_KEYS = frozenset({"epoch", "epsilon_one_run"})
_CURVE_PREFIXES = ("test_", "noisy_")


def _check_keys(what: str, keys: Any, allowed: frozenset) -> None:
    if extra := sorted(set(keys) - allowed):  # a dptune bug, never a user's: refuse to publish it
        raise ValueError(f"{what} would hold {extra}, which are not on the release whitelist")


@dataclass
class Release:
    """The outcome of a tuning run: the selected candidate, or nothing (a legitimate answer).

    Attributes:
      released, hparams: whether a candidate was selected, and its hyperparameters (calibrated
        noise included).
      validation_score: its score as the selection saw it (noisy when the validation is private).
      test_accuracy, test_metric: as ``trainer_protocol.ReleaseView``'s (public test split; not
        used for selection); with ``test_metric`` the validation score is in its units.
      privacy, privacy_text: the privacy statement as JSON (``total_epsilon``, ``delta``, ...)
        and in words.
      payload: the selected candidate's payload (for DP-SGD: ``{"params": ...}``).
      curve: per-epoch public quantities of the selected candidate (epsilon so far, metrics on
        public or privatised data; other keys are dropped), or None.
      path, outcome: the release folder, if one was written; ``RELEASED``, ``NONE_SELECTED`` or
        ``NO_CANDIDATE_SUCCEEDED`` (default: by ``released``).
      trainer_name: what trained the candidates (the report names it), e.g. "DP-SGD".
      published: what of the selected candidate the selection's theorem covers
        (``SelectionMethod.publishes``); ``validation_score`` is released only with ``"score"``.
    """

    released: bool
    hparams: dict[str, Any] | None
    validation_score: float | None
    test_accuracy: float | None
    privacy: dict[str, Any]
    privacy_text: str
    payload: Any = field(default=None, repr=False)
    curve: list[dict[str, Any]] | None = field(default=None, repr=False)
    path: Path | None = None
    outcome: str = ""
    trainer_name: str | None = None
    # The curator's view (number of candidates, all scores): never printed, never in release/.
    private: Any = field(default=None, repr=False, compare=False)
    published: tuple[str, ...] = ("payload", "score")
    test_metric: dict[str, Any] | None = None

    @property
    def params(self) -> Any:
        """The released model's parameters (``payload["params"]``), or None."""
        return self.payload.get("params") if isinstance(self.payload, dict) else None

    def __post_init__(self) -> None:
        self.outcome = self.outcome or (RELEASED if self.released else NONE_SELECTED)
        if self.curve is not None:  # a trainer's view may hand back more (an exact loss)
            public = lambda k: k in CURVE_KEYS or k.startswith(_CURVE_PREFIXES)  # noqa: E731
            if dropped := sorted({k for row in self.curve for k in row if not public(k)}):
                log.warning("the training curve's %s are not released (not public)", dropped)
            self.curve = [{k: v for k, v in row.items() if public(k)} for row in self.curve]

    def result_json(self) -> dict[str, Any]:
        if not self.released:
            return {"released": False, "reason": self.outcome}
        out = {"released": True, "hparams": self.hparams,
               "test_accuracy": _finite_or_none(self.test_accuracy)}  # fmt: skip
        if (m := self.test_metric) is not None:
            value = _finite_or_none(m.get("value"))
            out["test_metric"] = {"name": str(m.get("name")), "value": value}
        if "score" in self.published:
            out["validation_score"] = _finite_or_none(self.validation_score)
        return out

    def __repr__(self) -> str:
        eps = self.privacy.get("total_epsilon")
        return (
            f"Release(released={self.released}, hparams={self.hparams}, "
            f"validation_score={self.validation_score}, test_accuracy={self.test_accuracy}, "
            + (f"test_metric={self.test_metric}, " if self.test_metric is not None else "")
            + f"total_epsilon={eps}, delta={self.privacy.get('delta')}, path={self.path})"
        )

    @property
    def headline(self) -> str:
        """One line: the run's (epsilon, delta), epsilon rounded up (``headline``)."""
        return headline(self.privacy)

    def __str__(self) -> str:
        if self.outcome == NO_CANDIDATE_SUCCEEDED:
            head = ("Nothing released: no candidate succeeded (every candidate failed; "
                    "`dptune inspect WORKDIR` shows why).")  # fmt: skip
        elif not self.released:
            head = "Nothing released (no candidate selected: a legitimate private outcome)."
        else:
            hp = ", ".join(f"{k}={num(v)}" for k, v in (self.hparams or {}).items())
            head = f"Released: {hp}"
            if self.validation_score is not None:
                head += f"\n  validation score {num(self.validation_score)}"
                if self.test_metric is not None:
                    head += f" ({self.test_metric.get('name')})"
            if self.test_accuracy is not None:
                head += f"\n  test accuracy {num(self.test_accuracy)}"
            if (m := self.test_metric) is not None:
                head += f"\n  test {m.get('name')} {num(m.get('value'))}"
        return f"{head}\n{self.headline}\n\n{self.privacy_text}"


def headline(privacy: dict[str, Any]) -> str:
    """``Everything released ... is (eps, delta)-differentially private``, epsilon rounded *up*
    to 3 significant digits (rounding down would overstate the guarantee); the exact value is in
    the statement below it and in privacy.json."""
    eps, delta = privacy.get("total_epsilon"), privacy.get("delta")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps):
        return "Privacy: no finite guarantee (see the statement below)."
    up = float(eps)
    if up > 0:  # up to 3 significant digits: 3.99871 -> 4, 1.2301 -> 1.24
        scale = 10.0 ** (2 - math.floor(math.log10(up)))
        up = math.ceil(up * scale - 1e-9) / scale
    text = (
        f"Everything released by this run, tuning included, is ({up:.3g}, "
        f"{float(delta):.3g})-differentially private"
    )
    if privacy.get("private") is False:
        text += " -- NOT: this was a non-private debug run"
    return text + "."


def write_release(release: Release, folder: str | os.PathLike) -> Path:
    """Writes ``release`` to ``folder`` atomically (temp folder, then rename); returns it."""
    folder = Path(folder).absolute()
    # Both helpers live in the release's own parent, so the renames below stay on one file system
    # (rename is atomic there). A leftover of a killed write is removed, never trusted.
    tmp = folder.with_name(folder.name + ".tmp")
    old = folder.with_name(folder.name + ".old")
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    tmp.mkdir(parents=True)
    result = release.result_json()
    _check_keys(RESULT_FILE, result, RESULT_KEYS)
    _check_keys(PRIVACY_JSON, release.privacy, PRIVACY_KEYS)
    _write_json(tmp / RESULT_FILE, result)
    _write_json(tmp / PRIVACY_JSON, release.privacy)
    (tmp / PRIVACY_TXT).write_text(release.headline + "\n\n" + release.privacy_text.rstrip() + "\n")
    plots.epsilon_breakdown(release.privacy, tmp / "epsilon.png")
    if release.released:
        payload = release.payload
        params = payload.get("params") if isinstance(payload, dict) else None
        if params is not None and _is_array_tree(params):
            _save_orbax(params, tmp / "checkpoint")
        elif payload is not None:
            with open(tmp / "payload.pkl", "wb") as f:
                pickle.dump(payload, f)
        if release.curve:
            _write_json(tmp / "training_curve.json", release.curve)
            eps = release.privacy.get("total_epsilon")
            plots.training_curve(release.curve, tmp / "training_curve.png", eps)
    # report.md: a one-page summary linking the plots above (only those written)
    (tmp / "report.md").write_text(report_markdown(release, {p.name for p in tmp.iterdir()}))
    _check_keys("the release", (p.name for p in tmp.iterdir()), RELEASE_FILES)
    for dirpath, _, names in os.walk(tmp):  # on disk before the rename makes them the release
        for name in names:
            _fsync(os.path.join(dirpath, name))
        _fsync(dirpath, folder=True)
    if folder.exists():
        # Renamed away, not deleted in place: a kill during a deletion would leave half a release.
        # Between the two renames there is no release at all (complete or absent, never partial);
        # the journal has no ``released_at`` yet, so a rerun writes it again.
        os.replace(folder, old)
    os.replace(tmp, folder)
    _fsync(folder.parent, folder=True)
    if old.exists():
        shutil.rmtree(old)
    release.path = folder
    return folder


def _fsync(path: str | os.PathLike, folder: bool = False) -> None:
    """fsync ``path`` (durability of the release across a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not folder:  # some file systems refuse fsync on a folder: the files are what count
            raise
    finally:
        os.close(fd)


def read_release(folder: str | os.PathLike) -> Release:
    """Reads a release folder written by :func:`write_release` (the model stays on disk)."""
    folder = Path(folder)
    result = _read(folder / RESULT_FILE)
    privacy = _read(folder / PRIVACY_JSON)
    text = _read(folder / PRIVACY_TXT, bytes.decode).removeprefix(headline(privacy) + "\n\n")
    r = result.get
    return Release(
        bool(r("released")), r("hparams"), r("validation_score"), r("test_accuracy"), privacy,
        text.rstrip("\n"), path=folder, outcome=str(r("reason") or ""),
        published=tuple(privacy.get("published", ("payload",))), test_metric=r("test_metric"),
    )  # fmt: skip


def load_params(folder: str | os.PathLike, like: Any = None) -> Any:
    """Restores the released model's parameters from ``folder/checkpoint`` (orbax).

    ``like``: optional parameters (or ``jax.eval_shape`` of them, e.g. of ``module.init``) whose
    tree structure, shapes and dtypes the restored parameters must have; orbax refuses a
    checkpoint that does not match. Default: nested dicts of arrays, as ``module.apply({"params":
    ...})`` takes them. Partitioning boxes in ``like`` (``nn.with_logical_partitioning``) come
    back around the restored arrays (``apply`` takes them; the sharding names are kept). A Flax
    NNX module as ``like`` (or its ``nnx.State``): its trainable state, an ``nnx.State`` with
    the module's Variable metadata, for ``nnx.update(module, params)``.
    """
    import orbax.checkpoint as ocp  # heavy (JAX): only when a checkpoint is read or written

    path = Path(folder).absolute() / "checkpoint"
    for meta in sorted(path.rglob("*METADATA*")):  # orbax's JSON files: a cut one names itself
        if meta.is_file():
            _read(meta)
    with ocp.StandardCheckpointer() as ckpt:
        if like is None:
            return ckpt.restore(path)
        import flax.linen as nn  # heavy: the core stays JAX-free until a checkpoint is read
        import jax
        from flax import nnx

        if isinstance(like, nn.Module):
            raise TuningConfigError(
                f"like={like!r:.40}: a linen Module has no parameters before init: pass "
                "like=jax.eval_shape(module.init, key, x)['params'] (or leave like= out)"
            )
        if hasattr(like, "trainable_state"):  # trainers.nnx_model.NnxModel: its own filter
            like = like.trainable_state()
        elif isinstance(like, nnx.Module):
            like = nnx.state(like, nnx.Param)
        is_nnx = isinstance(like, nnx.State)
        plain = _string_keys(nnx.to_pure_dict(like)) if is_nnx else nn.meta.unbox(like)
        target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), plain)
        try:
            restored = ckpt.restore(path, target)
        except ValueError as e:  # orbax: another tree structure
            why = " ".join(str(e).split())
            raise TuningConfigError(
                f"like=: the release's parameters are not shaped like like= ({why:.300})"
            ) from None
        # orbax restores the stored shapes under like='s structure without a word: a release of
        # another model (another width, another LoRA rank) is refused here
        flat = jax.tree_util.tree_flatten_with_path(restored)[0]
        for (key, got), want in zip(flat, jax.tree_util.tree_leaves(target), strict=True):
            if got.shape != want.shape:
                where = "/".join(str(getattr(k, "key", k)) for k in key)
                raise TuningConfigError(
                    f"like=: the release's parameter {where!r} is {got.dtype}{list(got.shape)}, "
                    f"like= has {np.dtype(want.dtype)}{list(want.shape)}: the release was trained "
                    "with another model (e.g. another width or LoRA rank)"
                )
        if not is_nnx:
            return nn.meta.replace_boxed(like, restored)
        state = jax.tree_util.tree_map(lambda v: v, like)  # a copy: like stays as it is
        nnx.replace_by_pure_dict(state, restored)
        return state


def _string_keys(tree: Any) -> Any:
    """A nested dict with its keys as strings (NNX list indices are ints; releases hold
    strings)."""
    return {str(k): _string_keys(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def load_release(path: str | os.PathLike, like: Any = None) -> Release:
    """The release of a finished run, model included: ``path`` is the run's workdir or its
    ``release/`` folder. Its ``params`` are restored from the orbax checkpoint, in the structure
    of ``like`` when given (:func:`load_params`); use them as ``module.apply({"params":
    release.params}, x)``. A run that released nothing returns ``released=False``, no parameters.
    """
    folder = Path(path)
    if not (folder / RESULT_FILE).is_file() and (folder / "release" / RESULT_FILE).is_file():
        folder = folder / "release"
    if not (folder / RESULT_FILE).is_file():
        raise FileNotFoundError(
            f"{str(path)!r} holds no release: pass a tuning run's workdir or its release/ folder"
        )
    release = read_release(folder)
    if release.released:
        if (folder / "checkpoint").is_dir():
            release.payload = {"params": load_params(folder, like)}
        elif (folder / "payload.pkl").is_file():
            release.payload = _read(folder / "payload.pkl", pickle.loads)
    return release


def _save_orbax(params: Any, path: Path) -> None:
    # heavy (JAX): the core stays JAX-free until a checkpoint is written
    import jax
    import orbax.checkpoint as ocp

    params = jax.tree_util.tree_map(np.asarray, params)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path.absolute(), params)
        ckpt.wait_until_finished()
    # orbax notes the absolute folder it committed to (informational; only the file's presence is
    # read back): keep the release free of absolute paths, so it can be moved or copied.
    for note in path.rglob("commit_success.txt"):
        note.write_text(note.read_text().replace(str(path.absolute()), path.name))


def _is_array_tree(tree: Any) -> bool:
    import jax  # heavy: the core stays JAX-free unless a payload holds arrays

    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves)


def _read(path: Path, parse: Callable[[bytes], Any] = json.loads) -> Any:
    """``parse`` of the release file ``path``; StateError naming it when it is missing or damaged
    (JSON and decoding errors are ValueErrors)."""
    try:
        return parse(path.read_bytes())
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as e:
        what = e.strerror if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        raise StateError(
            f"the release file {path} cannot be read ({what}): the release is damaged (a copy or a "
            "disk cut short?); restore its folder from a backup"
        ) from None


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(x: Any) -> Any:
    if hasattr(x, "tolist"):  # NumPy and JAX scalars and arrays (``item`` fails on an array)
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)
