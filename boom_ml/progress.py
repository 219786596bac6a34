"""Progress on a terminal for work that takes seconds: each trace, the layout search.

Library calls (``boom_ml.predict(...)``, notebooks, tests) print nothing. The CLI turns it on
with :func:`to_terminal`. On a terminal one transient status line (rich) names the work
running now; a task started inside another (a trace inside the layout search) replaces the
line until it ends. Where stderr is not a terminal (a script, CI, a log), a spinner would
garble it, and silence for minutes (a 170 s trace, a max-batch search over every GPU) looked
hung: a plain line names the work running every :data:`LOG_EVERY_S` seconds, and a run
shorter than that prints none.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

LOG_EVERY_S = 30.0

_console: Any = None  # rich Console while on
_status: Any = None  # the live status line while a task runs
_messages: list[str] = []
_log: tuple[threading.Event, threading.Thread] | None = None  # the log's heartbeat, its stop


def to_terminal(console: Any = None) -> bool:
    """Show progress on ``console`` (default: stderr: a status line on a terminal, else a
    line every :data:`LOG_EVERY_S` seconds); True when a status line is on."""
    global _console
    if console is None:
        if not sys.stderr.isatty():
            to_log(sys.stderr)
            return False
        from rich.console import Console

        console = Console(stderr=True)
    _console = console
    return True


def to_log(stream: TextIO, every_s: float = LOG_EVERY_S) -> None:
    """Every ``every_s`` seconds, while a task runs, one line on ``stream``: the seconds since
    this call and the innermost task (a daemon thread; :func:`off` stops it)."""
    global _log
    off()
    started, stop = time.monotonic(), threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            running = _messages[-1:]  # one read: the main thread may end the task meanwhile
            if running:
                seconds = time.monotonic() - started
                stream.write(f"boom_ml: {seconds:.0f} s, {running[0]}\n")
                stream.flush()

    thread = threading.Thread(target=beat, name="boom_ml-progress", daemon=True)
    _log = (stop, thread)
    thread.start()


def off() -> None:
    global _console, _log
    _console = None
    if _log is not None:
        stop, thread = _log
        stop.set()
        thread.join(timeout=5)  # no line after off() returns
        _log = None
    _messages.clear()


@contextlib.contextmanager
def task(message: str) -> Iterator[None]:
    """Name ``message`` on the status line (or the log's next line) while the block runs
    (nothing when off)."""
    global _status
    if _console is None and _log is None:
        yield
        return
    _messages.append(message)
    if _console is not None:
        if _status is None:
            _status = _console.status(message)
            _status.start()
        else:
            _status.update(message)
    try:
        yield
    finally:
        _messages.pop()
        if _status is not None and _messages:
            _status.update(_messages[-1])
        elif _status is not None:
            _status.stop()
            _status = None
