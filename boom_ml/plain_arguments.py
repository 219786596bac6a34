"""NumPy scalars passed to the API as the Python numbers they hold.

A sweep driven from pandas or NumPy hands ``boom_ml.predict`` ``np.int64(8)`` for a batch
size and ``np.bool_(True)`` for a switch; the checks of ``specs.py`` take Python ``int`` and
``bool`` (a JSON document and the trace cache's keys hold those), and refused them with a
message that called 8 no integer. Each argument, and each value of a mapping or list
argument, is unwrapped with ``.item()`` before the checks; nothing else changes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from boom_ml.errors import InvalidInputError, suggest

F = TypeVar("F", bound=Callable[..., Any])


def plain(value: Any) -> Any:
    """``value`` with every NumPy scalar in it (at any depth of dicts, lists and tuples) as
    the Python scalar it holds; numpy is not imported."""
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return value.item()  # a scalar (np.int64, np.bool_, np.float32) or a 0-d array
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):  # not a named tuple, whose fields are arguments
        return type(value)(plain(v) for v in value)
    return value


def plain_arguments(func: F | None = None, *, hints: Mapping[str, str] | None = None) -> Any:
    """``func`` called with :func:`plain` of each of its arguments; a keyword it does not take
    is an InvalidInputError with a did-you-mean, as the CLI's unknown key is (it was Python's
    TypeError, which an ``except BoomError`` missed), or with its entry of ``hints`` (a CLI
    key the function has no argument for: where its job is done instead)."""
    if func is None:
        return lambda f: plain_arguments(f, hints=hints)
    said = dict(hints or {})
    params = inspect.signature(func).parameters
    names = list(params)
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values())

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        unknown = [] if open_ended else sorted(set(kwargs) - set(names))
        if unknown:
            raise InvalidInputError(
                f"{func.__name__}() takes no argument {unknown[0]!r}"
                + (f" ({said[unknown[0]]})" if unknown[0] in said else suggest(unknown[0], names))
            )
        return func(*(plain(a) for a in args), **{k: plain(v) for k, v in kwargs.items()})

    return wrapper  # type: ignore[return-value]
