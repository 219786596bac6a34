"""transformers' notices kept quiet while boom-ml builds and traces a model in the user's process.

transformers warns about configs as boom-ml builds them on purpose (a ``loss_type`` left unset:
"was set in the config but it is unrecognized. Using the default loss"), once per call from a
notebook. The command line sets ``TRANSFORMERS_VERBOSITY=error`` before anything imports
transformers (``boom_ml/predict.py``); the Python API is a guest in the user's process, so it
quiets them for the duration of a call and leaves the user's setting as it found it. A user who
set ``TRANSFORMERS_VERBOSITY`` themselves gets what they asked for.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
ENV = "TRANSFORMERS_VERBOSITY"


def quiet_transformers(func: F) -> F:
    """``func`` with transformers' warnings at error level while it runs."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if ENV in os.environ:  # the user's own choice
            return func(*args, **kwargs)
        imported = sys.modules.get("transformers") is not None
        before = _verbosity() if imported else logging.WARNING  # transformers' default
        if imported:
            _set_verbosity(logging.ERROR)
        else:  # read by transformers when it is first imported, inside func
            os.environ[ENV] = "error"
        try:
            return func(*args, **kwargs)
        finally:
            if not imported:
                os.environ.pop(ENV, None)
            if sys.modules.get("transformers") is not None:
                _set_verbosity(before)

    return wrapper  # type: ignore[return-value]


def _verbosity() -> int:
    from transformers.utils import logging as hf_logging

    return hf_logging.get_verbosity()


def _set_verbosity(level: int) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity(level)
