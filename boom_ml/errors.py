"""User-facing errors. The CLI prints ``str(err)`` on one line and exits 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class BoomError(Exception):
    """Base of every error caused by the user's input rather than by a bug."""

    exit_code = 2


class InvalidInputError(BoomError):
    """Any input the tool does not take: a key, a value, a model or a GPU."""


class UnknownModelError(InvalidInputError):
    """A model name no scheme resolves (an ``except InvalidInputError`` catches it too, as
    the README says of every bad input)."""


class UnknownGpuError(InvalidInputError):
    """A GPU id neither packaged nor a readable YAML spec."""


class TraceError(BoomError):
    """The model could not be traced on fake tensors (names the failing op when known)."""


class ArtifactError(BoomError):
    """A packaged or user-supplied model artifact is missing or corrupt."""


def close_matches(name: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``choices`` close to ``name`` (difflib's ratio, case-blind), closest first."""
    return difflib.get_close_matches(name.lower(), sorted(set(choices)), n=n, cutoff=0.5)


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ' (did you mean: a, b?)' for close matches of ``name`` in ``choices``, or ''."""
    close = close_matches(name, choices, n)
    return f" (did you mean: {', '.join(close)}?)" if close else ""


def interrupted(err: BaseException) -> bool:
    """Whether ``err`` comes of a Ctrl-C (a KeyboardInterrupt among its causes): such an error
    ends the run, never a fallback."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def last_line(err: BaseException) -> str:
    """An error's last non-empty line (huggingface_hub's validation errors name the class and
    validator first and the reason last; torch's name the tensor last), for a one-line error."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def one_value_per_channel(err: BaseException) -> bool:
    """Whether ``err`` is (or says, as a one-line TraceError does) PyTorch's refusal to train
    a BatchNorm over one value per channel (a 1x1 map at batch 1)."""
    return "expected more than 1 value per channel when training" in str(err).lower()
