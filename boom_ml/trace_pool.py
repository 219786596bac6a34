"""Traces that run beside the caller's work, in worker processes.

A prediction that searches the largest batch, covers GPUs of several attention groups or
advises traces one model several times (2–5 s each for an 8B model), and the advisor knows
each level's candidates before it evaluates the first. Those traces are independent, so
:class:`TracePool` runs the ones known in advance in worker processes while the caller
traces or replays in its own.

The workers are forked from the caller once, when the first trace is due and before the
caller runs one: a fork then carries torch, the tracer and the model library already
imported (a fresh interpreter would spend 3–4 s importing them, as long as a trace), and
autograd has not started its threads yet (a process forked after a backward pass cannot run
one: pytorch/pytorch wiki "Autograd and Fork"). The workers stay for the process's life and
take one trace at a time. A worker runs exactly what the caller would (:func:`trace`), so
its graph is the caller's; a worker that fails or dies leaves that trace to the caller,
where its error surfaces as it always has. Workers are daemonic: when the caller exits
(done, an error, Ctrl-C) they are terminated, not waited for.

``$BOOM_TRACE_WORKERS`` sets the number of workers (0: none). Without it the CLI starts as
many as the CPUs this process may use, at most :data:`MAX_DEFAULT_WORKERS`, and the Python
API none (a caller that ran autograd before its first prediction, as a notebook may, could
not fork useful workers). Only where Python forks safely (Linux); elsewhere every trace runs
in the caller.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from boom_ml import progress
from boom_ml.errors import InvalidInputError
from boom_ml.specs import ModelSpec, StepSpec

if TYPE_CHECKING:
    from boom_ml.trace.graph import OpGraph

WORKERS_ENV = "BOOM_TRACE_WORKERS"
# Each worker holds one model's trace (a few hundred MiB at most for an 8B model); past
# four the traces a prediction knows in advance rarely keep more busy.
MAX_DEFAULT_WORKERS = 4
# Imported before the fork, so that a worker starts tracing at once.
PRELOAD = ("boom_ml.trace.step", "boom_ml.zoo")
LIBRARY_OF_SCHEME = {"hf": "transformers", "torchvision": "torchvision", "timm": "timm"}
FORKS = sys.platform.startswith("linux")  # macOS and Windows do not fork a threaded process safely
_POLL_S = 0.02
_DEFAULT_ON = False  # set by the CLI (see the module's docstring)


def use_by_default() -> None:
    """Start workers without ``$BOOM_TRACE_WORKERS`` (what the CLI does)."""
    global _DEFAULT_ON
    _DEFAULT_ON = True


def configured_workers() -> int:
    """``$BOOM_TRACE_WORKERS``, else (CLI) the usable CPUs up to :data:`MAX_DEFAULT_WORKERS`
    (none on one CPU: a worker would only take turns with the caller), else none."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if text:
        try:
            value = int(text)
        except ValueError:
            raise InvalidInputError(f"{WORKERS_ENV} must be a whole number, got {text!r}") from None
        return max(value, 0)
    if not _DEFAULT_ON:
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cpus or 1, MAX_DEFAULT_WORKERS) if (cpus or 1) > 1 else 0


def trace(model: ModelSpec, step: StepSpec) -> OpGraph:
    """Build ``model`` afresh and trace ``step``: what the caller and every worker run. A deep
    hf: model with identical layers is traced shallow and one layer repeated
    (``trace/repeat.py``), where a trace one layer deeper confirms it."""
    from boom_ml.trace.repeat import trace_repeated
    from boom_ml.trace.step import trace_step
    from boom_ml.zoo import build_model

    graph = trace_repeated(model, step)
    if graph is not None:
        return graph
    # trace_step materialises and may checkpoint the module: a fresh build each time
    return trace_step(build_model(model), step)


def take_or_trace(
    model: ModelSpec, step: StepSpec, here: Callable[[], OpGraph] | None = None
) -> OpGraph:
    """The graph of ``step``: a worker's when one was started for it, else traced in this
    process (``here``, default :func:`trace`), the workers forked first: this may be the
    process's first backward pass."""
    pool = shared_pool(model)
    if pool is not None:
        if pool.pending(model, step):
            with progress.task(f"tracing {model.shown}: {step.label()} (in a worker)"):
                graph = pool.take(model, step)
            if graph is not None:
                return graph
        pool.start()
    return here() if here is not None else trace(model, step)


def _serve(conn: Connection) -> None:
    """A worker: trace each (model, step) received until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    os.environ[WORKERS_ENV] = "0"  # a worker starts no pool of its own
    progress.off()  # the caller's status line (and its thread) stay the caller's
    while True:
        try:
            model, step = conn.recv()
        except (EOFError, OSError):
            return
        try:
            outcome: tuple[str, Any] = ("ok", trace(model, step))
        except Exception as err:  # noqa: BLE001 - reported; the caller traces it itself
            outcome = ("error", f"{type(err).__name__}: {err}")
        conn.send(outcome)


@dataclass
class _Worker:
    process: Any
    conn: Connection
    job: tuple[str, StepSpec] | None = None  # the trace it runs now


class TracePool:
    """Traces started ahead of need; :meth:`take` returns one (or None: trace it yourself).

    Keyed by (model text, step): a prediction's session asks for its own steps.
    """

    def __init__(self, workers: int, preload: tuple[str, ...] = PRELOAD) -> None:
        self.workers = workers
        self.started = 0  # traces handed to workers (tests and benchmarks read it)
        self._preload = preload
        self._crew: list[_Worker] | None = None  # forked on first use
        self._specs: dict[tuple[str, StepSpec], ModelSpec] = {}
        self._queue: list[tuple[str, StepSpec]] = []  # submitted, no worker yet
        self._done: dict[tuple[str, StepSpec], tuple[str, Any]] = {}
        self.broken = False  # no worker can trace here: submit() does nothing

    def start(self) -> None:
        """Fork the workers now (before this process runs autograd); a no-op once done."""
        if self._crew is not None or self.broken:
            return
        self._crew = []
        for name in self._preload:  # what every trace imports: once, before the fork
            importlib.import_module(name)
        ctx = multiprocessing.get_context("fork")
        for _ in range(self.workers):
            mine, theirs = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(theirs,), daemon=True)
            try:
                process.start()
            except OSError:  # no processes left to fork: the caller traces
                mine.close()
                break
            finally:
                theirs.close()
            self._crew.append(_Worker(process, mine))
        self.broken = not self._crew

    def submit(self, model: ModelSpec, step: StepSpec) -> None:
        """Trace ``step`` of ``model`` in a worker (queued while every worker is busy)."""
        key = (model.text, step)
        if self.broken or self.pending(model, step):
            return
        self.start()
        self._specs[key] = model
        self._queue.append(key)
        self._pump()

    def pending(self, model: ModelSpec, step: StepSpec) -> bool:
        return (model.text, step) in self._specs

    def take(self, model: ModelSpec, step: StepSpec) -> OpGraph | None:
        """The graph of a submitted step, waiting for its worker; None if it was not
        submitted or its worker failed."""
        key = (model.text, step)
        if key not in self._specs:
            return None
        if key in self._queue:  # its turn is now
            self._queue.remove(key)
            self._queue.insert(0, key)
        while key not in self._done:
            self._pump()
            if key not in self._done:
                if not self._alive():
                    self._done[key] = ("error", "no worker left")
                    break
                time.sleep(_POLL_S)
        del self._specs[key]
        kind, value = self._done.pop(key)
        if kind == "error" and "Autograd-and-Fork" in str(value):
            self.broken = True  # forked after a backward pass: no worker can trace
        return value if kind == "ok" else None

    def _alive(self) -> list[_Worker]:
        return [w for w in self._crew or [] if w.process.is_alive()]

    def _pump(self) -> None:
        """Collect finished traces, then hand queued ones to idle workers."""
        for worker in self._crew or []:
            if worker.job is None:
                continue
            if worker.conn.poll():
                try:
                    self._done[worker.job] = worker.conn.recv()
                except (EOFError, OSError):
                    self._done[worker.job] = ("error", "the worker exited mid-trace")
                worker.job = None
            elif not worker.process.is_alive():
                self._done[worker.job] = ("error", f"the worker died ({worker.process.exitcode})")
                worker.job = None
        idle = [w for w in self._alive() if w.job is None]
        while self._queue and idle:
            worker, key = idle.pop(0), self._queue.pop(0)
            try:
                worker.conn.send((self._specs[key], key[1]))
            except OSError:  # it died since it was seen alive: the caller traces this one
                self._done[key] = ("error", "the worker exited before its trace")
                continue
            worker.job = key
            self.started += 1


_SHARED: TracePool | None = None


def shared_pool(model: ModelSpec) -> TracePool | None:
    """The process's pool (None when no workers are configured or the platform does not
    fork); the first model that asks names the library its workers inherit imported."""
    global _SHARED
    workers = configured_workers() if FORKS else 0
    if workers == 0:
        return None
    if _SHARED is None or _SHARED.workers != workers:
        library = LIBRARY_OF_SCHEME.get(str(model.scheme))
        _SHARED = TracePool(workers, PRELOAD + ((library,) if library else ()))
    return _SHARED
