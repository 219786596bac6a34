"""gemm_spread: the TFLOPS a GEMM model implies, and the spread across fold models."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from boom_ml.timing.roofline import LAUNCH_MS
from training import gemm_spread


class _AtRoofline:
    """Predicts ``scale`` x the plain roofline + launch (the floor every GEMM model keeps)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def predict_ms(self, feats: pd.DataFrame) -> np.ndarray:
        return self.scale * feats["bound_ms"].to_numpy()


def test_tflops_at_the_roofline_is_the_spec_peak_and_spread_names_the_slowest_fold() -> None:
    models = {"packaged": _AtRoofline(1.0), "without t4": _AtRoofline(1.0),
              "without l4": _AtRoofline(2.0), "variant x": _AtRoofline(4.0)}  # fmt: skip
    table = gemm_spread.tflops(models, ["h100-sxm"])  # type: ignore[arg-type]
    big32, big16 = "linear 8192x8192x8192 float32", "linear 8192x8192x8192 float16"
    packaged = table.set_index("model").loc["packaged"]
    # 8192^3 is compute-bound on the H100 SXM: at the roofline it runs at the spec-sheet
    # peak (66.9 TFLOPS fp32, 989.4 fp16: gpus.csv), less the launch cost.
    flops = 2.0 * 8192**3

    def at_peak(tflops: float) -> float:
        return flops / (flops / (tflops * 1e12) + LAUNCH_MS * 1e-3) / 1e12

    assert packaged[big32] == pytest.approx(at_peak(66.9), rel=1e-9)
    assert packaged[big16] == pytest.approx(at_peak(989.4), rel=1e-9)
    slow = table.set_index("model").loc["without l4", big32]
    assert slow == pytest.approx(at_peak(66.9) / 2, rel=1e-9)
    spread = gemm_spread.spread(table).set_index("shape")
    assert spread.loc[big32, "max / min"] == pytest.approx(2.0)
    assert spread.loc[big32, "fold at min"] == "without l4"
    assert spread.loc[big32, "packaged"] == pytest.approx(at_peak(66.9), rel=1e-9)
    assert list(spread.index) == gemm_spread.labels()


def test_arguments_name_gpus_by_id_or_alias_and_refuse_the_rest(capsys) -> None:
    assert gemm_spread.parse_args([]) == (["h100-sxm", "h200"], None)
    assert gemm_spread.parse_args(["gpus=H100 SXM,l4", "variant=v"]) == (["h100-sxm", "l4"], "v")
    with pytest.raises(SystemExit, match="unknown argument 'gpu=l4'"):
        gemm_spread.parse_args(["gpu=l4"])
    assert gemm_spread.main(["--help"]) is None
    assert "python -m training.gemm_spread" in capsys.readouterr().out
