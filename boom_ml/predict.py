"""`python -m boom_ml.predict`: memory and step time of one training step, per GPU.

Examples:
  python -m boom_ml.predict model=hf:gpt2 gpu=[a100-80gb-sxm,h100-sxm,l4] batch_size=8 seq_len=1024 amp=bf16 output=json
  python -m boom_ml.predict model=torchvision:resnet50 gpu=all batch_size=64
Run with --help for every option (Hydra syntax: key=value).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

from boom_ml.errors import BoomError, InvalidInputError, suggest

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
OUTPUTS = ("table", "json")


def run(cfg: Any) -> str:
    """Plain function behind the CLI: a config mapping in, the rendered output out."""
    from omegaconf import OmegaConf

    from boom_ml.api import predict
    from boom_ml.report.table import render_table

    options = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    output = options.pop("output", "table")
    explain = bool(options.pop("explain", False))
    if output not in OUTPUTS:
        raise InvalidInputError(f"unknown output {output!r}; choose one of: {', '.join(OUTPUTS)}")
    known = set(predict.__code__.co_varnames[: predict.__code__.co_argcount])
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidInputError(f"unknown option(s): {', '.join(unknown)}")
    prediction = predict(**options)
    if output == "json":
        return json.dumps(prediction.to_dict(), indent=2)
    text = render_table(prediction, explain=explain)
    if prediction.plots:
        text += "\nplots: " + ", ".join(prediction.plots)
    return text


def check_override_keys(argv: list[str], config_name: str = "predict") -> None:
    """Reject ``typo=value`` with one line instead of Hydra's multi-line struct error."""
    import yaml

    known = set(yaml.safe_load((Path(CONFIG_DIR) / f"{config_name}.yaml").read_text()))
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        if "=" in arg and not arg.startswith("-") and key.split(".")[0] not in known | {"hydra"}:
            raise InvalidInputError(f"unknown option {key!r}{suggest(key, known)}")


def main() -> None:
    import hydra

    # transformers' notices about configs we build on purpose are noise on a terminal
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    try:
        check_override_keys(sys.argv[1:])
    except BoomError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)

    @hydra.main(config_path=CONFIG_DIR, config_name="predict", version_base="1.3")
    def _entry(cfg: Any) -> None:
        try:
            print(run(cfg))
        except BoomError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)

    _entry()


class _CallableModule(types.ModuleType):
    """Lets ``boom_ml.predict(model=..., gpu=...)`` call :func:`boom_ml.api.predict`.

    The CLI contract fixes the module name ``boom_ml.predict`` and the Python API fixes
    the call ``boom_ml.predict(...)``; a callable module satisfies both.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from boom_ml.api import predict

        return predict(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
