"""Progress on a terminal for work that takes seconds: each trace, the layout search.

Library calls (``boom_ml.predict(...)``, notebooks, tests) print nothing. The CLI turns it on
with :func:`to_terminal`, and only when stderr is a terminal: a script that pipes the JSON or
keeps a log sees no spinner. On a terminal one transient status line (rich) names the work
running now; a task started inside another (a trace inside the layout search) replaces the
line until it ends.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

_console: Any = None  # rich Console while on
_status: Any = None  # the live status line while a task runs
_messages: list[str] = []


def to_terminal(console: Any = None) -> bool:
    """Show progress on ``console`` (default: stderr, if it is a terminal); True when on."""
    global _console
    if console is None:
        if not sys.stderr.isatty():
            return False
        from rich.console import Console

        console = Console(stderr=True)
    _console = console
    return True


def off() -> None:
    global _console
    _console = None


@contextlib.contextmanager
def task(message: str) -> Iterator[None]:
    """Name ``message`` on the status line while the block runs (nothing when off)."""
    global _status
    if _console is None:
        yield
        return
    _messages.append(message)
    if _status is None:
        _status = _console.status(message)
        _status.start()
    else:
        _status.update(message)
    try:
        yield
    finally:
        _messages.pop()
        if _messages:
            _status.update(_messages[-1])
        else:
            _status.stop()
            _status = None
