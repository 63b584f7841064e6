"""The ``dptune`` command's sidecar: a second process that does, on another core, two pieces of
public work the command would otherwise do on its critical path.

1. **One-step PLDs built ahead.** A warm run (a second run of a config, a resumed run) skips the
   noise search (the remembered calibration) and JAX's compilation (the compilation cache) but
   must still prove its guarantee at the remembered sigma, and the proof starts with
   dp_accounting's PLD of one Poisson-subsampled Gaussian step: 0.6-0.8 s of Python. The
   command's first 2.5 s are imports (JAX, dp_accounting, scipy) on ONE core; meanwhile the
   sidecar builds the step PLDs the previous run of the same command line built.
2. **The release's plots.** matplotlib's import and the two figures take ~1 s; the sidecar
   imports matplotlib while the candidates train and draws the figures while the command writes
   the rest of the release (``draw``, ``finish_drawing``).

What is remembered and what is not. The file ``cache_root()/sidecar/<digest>.json`` (digest of
the command line without ``--workdir``, and of the current folder) holds only *requests*: the
(noise multiplier, sampling rate, discretisation, neighbouring relation) of the step PLDs the last
run of that command line built at the default discretisation, public functions of the public
config. No privacy number is read from disk: the sidecar is started by this run, runs this
installation's code (``epsilon.build_step_pld``, the function the run would call itself) and
sends the PLDs over a pipe; the run uses one only for a request exactly equal to its own
(:func:`take`) and builds every other PLD itself. The plots it draws are of the release's own
public numbers (``privacy.json``, ``training_curve.json``), with ``dptune.plots``. A missing,
stale or damaged file, a sidecar that fails, dies or is slower than :data:`WAIT_S`, or a config
that changed all end the same way: the command does that work itself, with the same result.

Only the ``dptune`` tuning command starts a sidecar (``dptune.cli.run``), only on a POSIX machine
with at least 2 usable cores; the requests file is read and written only with warm starts on
(not ``--compilation_cache=off``, not ``$DPTUNE_COMPILATION_CACHE=off``). The library
(``dptune.tune``) never spawns processes: there, :func:`take` returns None and :func:`draw`
draws in-process. This module imports nothing heavy: it runs before JAX and dp_accounting load.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import pickle
import selectors
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Step PLDs remembered per command line (the last ones built; a warm run builds one).
MAX_REQUESTS = 4

#: Seconds the command waits for one answer of the sidecar before doing that work itself (a PLD
#: or a figure takes under a second; the sidecar has had the command's whole start-up).
WAIT_S = 60.0

#: The plots the sidecar may draw (``dptune.plots`` functions of JSON arguments).
PLOTS = ("epsilon_breakdown", "training_curve")

log = logging.getLogger("dptune")

_FORMAT = "dptune-sidecar-1"

# The sidecar imports this very copy of dptune (its folder first on the path), never another one
# that happens to sit in the current folder.
_ROOT = Path(__file__).resolve().parents[1]
_SERVE = "import sys; sys.path.insert(0, {root!r}); from dptune.sidecar import _serve; _serve()"
_HEADER = struct.Struct("<Q")  # each answer: its length, then a pickle

# A request: (noise_multiplier, sampling_prob, discretization, relation name or None).
Request = tuple[float, float, float, "str | None"]

_lock = threading.RLock()
_state: dict[str, Any] = {
    "path": None, "proc": None, "promised": frozenset(), "built": None, "pid": None,
}  # fmt: skip
_noted: list[Request] = []
_drawing: list[tuple[str, list]] = []  # jobs sent to the sidecar, not answered yet


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cache_off(argv: Sequence[str]) -> bool:
    """Whether warm starts are off for this command line (the flag or the environment)."""
    from dptune.cachedir import OFF_WORDS, warm_starts_off

    if warm_starts_off():
        return True
    for i, arg in enumerate(argv):
        value = None
        if arg.startswith("--compilation_cache="):
            value = arg.split("=", 1)[1]
        elif arg == "--compilation_cache" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and value.strip().lower() in OFF_WORDS:
            return True
    return False


def request_path(argv: Sequence[str], cwd: str | os.PathLike) -> Path:
    """The requests file of this command line: ``cache_root()/sidecar/<digest>.json``, the digest
    of the arguments (``--workdir`` left out: a fresh folder is the same config) and of ``cwd``
    (relative paths in the arguments)."""
    from dptune.cachedir import cache_root

    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workdir":
            skip = True
        elif not arg.startswith("--workdir="):
            kept.append(arg)
    text = json.dumps([_FORMAT, str(cwd), kept])
    return cache_root() / "sidecar" / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def _parse_requests(text: str) -> list[Request]:
    """The well-formed requests in ``text`` (JSON), the last :data:`MAX_REQUESTS`."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    out: list[Request] = []
    for item in data if isinstance(data, list) else []:
        if not (isinstance(item, list) and len(item) == 4):
            continue
        sigma, q, disc, relation = item
        numbers = (sigma, q, disc)
        if not all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in numbers):
            continue
        if q > 1 or not (relation is None or isinstance(relation, str)):
            continue
        out.append((sigma, q, disc, relation))
    return out[-MAX_REQUESTS:]


def start(argv: Sequence[str], cwd: str | os.PathLike | None = None) -> bool:
    """Starts the sidecar for this command line (POSIX, 2 or more usable cores), with the step
    PLDs its last run left as requests (read only with warm starts on, where this run's own go
    too). Returns whether a sidecar was started. Never raises: it is a convenience."""
    stop()  # a second start (tests) replaces the first
    try:
        requests: list[Request] = []
        if not _cache_off(argv):
            path = request_path(argv, os.getcwd() if cwd is None else cwd)
            with _lock:
                _state.update(path=path, pid=os.getpid())
            try:
                requests = _parse_requests(path.read_text())
            except OSError:
                pass
        if os.name != "posix" or _usable_cores() < 2:
            return False
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE.format(root=str(_ROOT)), json.dumps(requests)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C at the terminal is the command's, not the sidecar's
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - no sidecar: the command does the work itself
        return False
    with _lock:
        _state.update(proc=proc, promised=frozenset(requests), built=None, pid=os.getpid())
    atexit.unregister(stop)
    atexit.register(stop)
    return True


def _mine() -> bool:
    """Whether the sidecar state is this process's (a forked child -- a worker -- has none: the
    pipes and the requests file are its parent's)."""
    return _state["pid"] == os.getpid()


def running() -> bool:
    """Whether this process has a live sidecar."""
    with _lock:
        proc = _state["proc"]
        return _mine() and proc is not None and proc.poll() is None


def _request(noise_multiplier, sampling_prob, discretization, relation) -> Request:
    name = None if relation is None else getattr(relation, "name", str(relation))
    return (float(noise_multiplier), float(sampling_prob), float(discretization), name)


def _read_answer(proc: subprocess.Popen) -> Any:
    """The sidecar's next answer (unpickled); raises on EOF, a damaged frame or ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    fd = proc.stdout.fileno()

    def read(n: int) -> bytes:
        chunks, left = [], n
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while left:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError("the sidecar did not answer in time")
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    raise EOFError("the sidecar ended")
                chunks.append(chunk)
                left -= len(chunk)
        return b"".join(chunks)

    (size,) = _HEADER.unpack(read(_HEADER.size))
    return pickle.loads(read(size))


def _built() -> dict:
    """The sidecar's first answer, the step PLDs (read once; {} when it failed)."""
    with _lock:
        if _state["built"] is None:
            proc = _state["proc"]
            try:
                built = {} if proc is None else _read_answer(proc)
            except Exception as e:  # noqa: BLE001 - the command builds its PLDs itself
                log.debug("the sidecar's step PLDs are not used (%s): built here", e)
                built = {}
                _kill(proc)
            _state["built"] = built if isinstance(built, dict) else {}
        return _state["built"]


def take(noise_multiplier: float, sampling_prob: float, discretization: float, relation=None):
    """The sidecar's PLD for exactly this request, or None (no sidecar, not requested, or the
    sidecar failed or is slower than ``WAIT_S``): then the caller builds it."""
    key = _request(noise_multiplier, sampling_prob, discretization, relation)
    with _lock:
        if not _mine() or key not in _state["promised"]:
            return None
    pld = _built().get(key)
    if pld is not None:
        log.debug("the step PLD of sigma=%r, q=%r is the sidecar's (built as the command started)",
                  key[0], key[1])  # fmt: skip
    return pld


def note(noise_multiplier: float, sampling_prob: float, discretization: float, relation=None):
    """Records a step PLD this run built (or took) at the default discretisation, as a request
    for the next run of the same command line (only in a command that called :func:`start`)."""
    from dptune.accounting.epsilon import PLD_DISCRETIZATION
    from dptune.cachedir import warm_starts_off

    with _lock:
        path = _state["path"]
        if path is None or not _mine() or discretization != PLD_DISCRETIZATION:
            return
        if warm_starts_off():
            return
        key = _request(noise_multiplier, sampling_prob, discretization, relation)
        if key in _noted:
            _noted.remove(key)
        _noted.append(key)
        del _noted[:-MAX_REQUESTS]
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps([list(r) for r in _noted]))
            os.replace(tmp, path)
        except OSError:  # the next run builds its PLD itself
            pass


def draw(plot: str, *args: Any) -> None:
    """``dptune.plots.<plot>(*args)`` (arguments as JSON gives them back, the output path among
    them), by the sidecar if one runs (then :func:`finish_drawing` waits for it), else here and
    now."""
    if plot not in PLOTS:
        raise ValueError(f"plot={plot!r}: expected one of {PLOTS}")
    with _lock:
        if running():
            _built()  # the PLDs' answer first: the sidecar sends it before it reads a job
            proc = _state["proc"]
            if proc is not None and proc.poll() is None:
                try:
                    proc.stdin.write(json.dumps([plot, args]).encode() + b"\n")
                    proc.stdin.flush()
                    _drawing.append((plot, args))
                    return
                except Exception:  # noqa: BLE001 - drawn here instead
                    _kill(proc)
    _draw_here(plot, args)


def finish_drawing() -> None:
    """Waits for every figure sent to the sidecar; draws here each one it did not draw."""
    with _lock:
        jobs = list(_drawing)
        _drawing.clear()
        proc = _state["proc"]
        for i in range(len(jobs)):
            try:
                answer = _read_answer(proc)
            except Exception as e:  # noqa: BLE001
                answer = e
            if answer != "ok":  # this figure and the ones after it are drawn here
                log.debug("the sidecar did not draw %s (%s): drawn here", jobs[i][0], answer)
                _kill(proc)
                for plot, args in jobs[i:]:
                    _draw_here(plot, args)
                return


def abandon_drawing() -> None:
    """Forgets the figures sent and not answered (the release that asked for them failed): the
    sidecar is ended, so that none of its answers is read as a later figure's."""
    with _lock:
        if _drawing:
            _drawing.clear()
            _kill(_state["proc"])


def _draw_here(plot: str, args: list) -> None:
    from dptune import plots

    getattr(plots, plot)(*args)


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    with _lock:
        if _state["proc"] is proc:
            _state["proc"] = None


def stop() -> None:
    """Ends the sidecar (at exit: it may still be waiting for figures that never came)."""
    with _lock:
        if not _mine():
            return  # a forked child's exit: the sidecar is its parent's
        proc = _state["proc"]
        _state.update(proc=None, promised=frozenset(), built=None, path=None, pid=None)
        _noted.clear()
        _drawing.clear()
    if proc is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
        _kill(proc)


def _answer(obj: Any) -> None:
    data = pickle.dumps(obj)
    sys.stdout.buffer.write(_HEADER.pack(len(data)) + data)
    sys.stdout.buffer.flush()


def _serve(requests_json: str | None = None) -> None:
    """The sidecar: answers the step PLDs of the requests (its argument, JSON) as ``{request:
    PLD}``, built by ``epsilon.build_step_pld``; then draws each job read from stdin (one JSON
    line, ``[plot, args]``), answering "ok" or the error's text; ends at end of input."""
    built = {}
    requests = _parse_requests(sys.argv[1] if requests_json is None else requests_json)
    if requests:
        from dp_accounting import privacy_accountant

        from dptune.accounting.epsilon import build_step_pld

        for sigma, q, disc, relation in requests:
            rel = None if relation is None else privacy_accountant.NeighboringRelation[relation]
            built[(sigma, q, disc, relation)] = build_step_pld(sigma, q, disc, rel)
    _answer(built)
    if hasattr(os, "nice"):
        os.nice(10)  # what is left (matplotlib's import) runs while the candidates train
    from matplotlib.backends import backend_agg  # noqa: F401 - loaded before the first job
    from matplotlib.figure import Figure  # noqa: F401

    from dptune import plots

    for line in sys.stdin.buffer:
        try:
            plot, args = json.loads(line)
            if plot not in PLOTS:
                raise ValueError(f"unknown plot {plot!r}")
            getattr(plots, plot)(*args)
            _answer("ok")
        except Exception as e:  # noqa: BLE001 - the command draws it itself
            _answer(f"{type(e).__name__}: {e}")
