"""`python -m boom_ml.predict`: memory and step time of one training step, per GPU.

Examples:
  python -m boom_ml.predict model=hf:gpt2 gpu=[a100-80gb-sxm,h100-sxm,l4] batch_size=8 seq_len=1024 amp=bf16 output=json
  python -m boom_ml.predict model=torchvision:resnet50 gpu=all batch_size=64
Run with --help for every option (Hydra syntax: key=value).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from boom_ml.errors import BoomError, InvalidInputError

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
OUTPUTS = ("table", "json")


def run(cfg: Any) -> str:
    """Plain function behind the CLI: a config mapping in, the rendered output out."""
    from omegaconf import OmegaConf

    from boom_ml.api import predict
    from boom_ml.report.table import render_table

    options = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    output = options.pop("output", "table")
    if output not in OUTPUTS:
        raise InvalidInputError(f"unknown output {output!r}; choose one of: {', '.join(OUTPUTS)}")
    known = set(predict.__code__.co_varnames[: predict.__code__.co_argcount])
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidInputError(f"unknown option(s): {', '.join(unknown)}")
    prediction = predict(**options)
    if output == "json":
        return json.dumps(prediction.to_dict(), indent=2)
    return render_table(prediction)


def main() -> None:
    import hydra

    @hydra.main(config_path=CONFIG_DIR, config_name="predict", version_base="1.3")
    def _entry(cfg: Any) -> None:
        try:
            print(run(cfg))
        except BoomError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)

    _entry()


if __name__ == "__main__":
    main()
