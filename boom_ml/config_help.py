"""``--help`` for the Hydra entries: what the command does, then every key with its comment.

Hydra's own ``--help`` lists the config groups and dumps the composed config without the
comments that say what a key means, which values it takes and why a default is what it is.
The entries (``boom_ml.predict_ops``, ``training.train_*``, ``data_collection.kernels`` /
``steps``) print their module docstring and their YAML file as written instead; Hydra's
flags stay behind ``--hydra-help``. ``boom_ml.predict`` keeps its own hand-written help.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from boom_ml.errors import InvalidInputError

# The Hydra YAMLs live at the repository's top level (configs/), beside the package: boom-ml
# runs from its checkout (pip install -e .), and a wheel without them says so in one line.
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
HELP_FLAGS = ("--help", "-h")
# Top-level YAML blocks that are Hydra's, not the user's: the defaults list and hydra.*
_HYDRA_BLOCKS = ("defaults:", "hydra:")


def require_configs() -> str:
    """``CONFIG_DIR`` as text for ``hydra.main``; InvalidInputError where it is missing."""
    if not (CONFIG_DIR / "predict.yaml").is_file():
        raise InvalidInputError(
            f"boom-ml's configs/ folder is not beside its package ({CONFIG_DIR}): boom-ml runs "
            "from its source checkout; install it with `pip install -e .` there"
        )
    return str(CONFIG_DIR)


def help_requested(argv: Sequence[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in argv)


def config_keys(config_name: str) -> str:
    """``configs/<config_name>.yaml`` as written, less Hydra's own blocks and directives."""
    lines = (CONFIG_DIR / f"{config_name}.yaml").read_text().splitlines()
    out: list[str] = []
    skipping = False
    for line in lines:
        if line and not line[0].isspace() and not line.startswith("#"):
            skipping = line.startswith(_HYDRA_BLOCKS)
        if skipping or line.startswith("# @package"):
            continue
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out)


def help_text(doc: str | None, config_name: str) -> str:
    """The docstring, then the keys of ``configs/<config_name>.yaml`` with their comments."""
    return (
        f"{(doc or '').strip()}\n\n"
        f"Keys (override any as key=value; defaults and comments from "
        f"configs/{config_name}.yaml):\n\n{config_keys(config_name)}\n\n"
        "Hydra's own flags (multirun -m, launchers, --cfg job): --hydra-help"
    )


def print_help_if_asked(
    doc: str | None, config_name: str, argv: Sequence[str] | None = None
) -> bool:
    """Print :func:`help_text` and say True when ``argv`` (default: the command line) asks.
    Every Hydra entry calls it first: without the checkout's configs/ it ends the process
    with one line (exit 2) instead of Hydra's traceback."""
    try:
        require_configs()
    except InvalidInputError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if not help_requested(sys.argv[1:] if argv is None else argv):
        return False
    print(help_text(doc, config_name))
    return True


def doc_help_or_no_args(doc: str | None, argv: Sequence[str] | None = None) -> bool:
    """For commands without options: print ``doc`` and say True on ``--help``; any other
    argument ends the process with one line and exit status 2 (it would be ignored)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if help_requested(argv):
        print((doc or "").strip())
        return True
    if argv:
        print(f"error: this command takes no arguments (got {' '.join(argv)}); --help says what it does",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return False


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """A command's expected failures, a BoomError or a dataset not imported yet (a fresh
    clone's empty ``data/``), as one line on stderr and exit status 2, not a traceback."""
    from boom_ml.errors import BoomError

    try:
        yield
    except (BoomError, FileNotFoundError) as err:
        print(f"error: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
