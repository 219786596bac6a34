"""What cuDNN's NCHW layout transforms (``boom_ml/timing/conv_layout.py``) change, on real steps.

``python -m training.layout_check`` prints two tables from the GNN's step rows and the packaged
per-op heads (the sum of per-op times):

1. timm's training rows measured in both layouts (``../shared/data/timm_bench``: the same
   model, batch and RTX 3090, ``nchw`` and ``nhwc`` files): the median NHWC / NCHW step-time
   ratio per model family, measured and predicted. The RTX 3090 has no kernel rows, so no head
   saw that GPU's kernels, and no constant of the transforms was fitted.
2. Every step row by source and precision: MAPE and median measured / predicted of the per-op
   sum with the transforms and without them (every row timed as if channels_last).

Tracing the step rows takes about 8 minutes the first time (``data/graph_cache``), then about
two minutes for both tables.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from boom_ml.timing.gnn_features import HeadsTimes
from boom_ml.timing.heads import load_model as load_heads  # what per_op="per-op" featurises with
from training.graph_dataset import build_dataset


class WithoutTransforms(HeadsTimes):
    """The heads' per-node times with every convolution timed as in channels_last."""

    def many(self, nodes, gpus, tf32, channels_last: bool = False) -> np.ndarray:  # noqa: ANN001
        return super().many(nodes, gpus, tf32, channels_last=True)


def paired_ratios(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (model, batch) measured in both layouts: family, measured and predicted
    NHWC / NCHW ratios (``target_ms`` measured, ``baseline_ms`` the per-op sum)."""
    keys = ["model", "batch_size"]
    both = rows.pivot_table(index=keys, columns="channels_last",
                            values=["target_ms", "baseline_ms"]).dropna()  # fmt: skip
    family = rows.groupby("model")["family"].first()
    out = pd.DataFrame({
        "measured": both[("target_ms", True)] / both[("target_ms", False)],
        "predicted": both[("baseline_ms", True)] / both[("baseline_ms", False)],
    }).reset_index()  # fmt: skip
    return out.assign(family=out["model"].map(family))


def summary(pairs: pd.DataFrame) -> pd.DataFrame:
    """Median ratios and pair counts per family and over all pairs."""
    per = pairs.groupby("family").agg(pairs=("model", "size"), measured=("measured", "median"),
                                      predicted=("predicted", "median"))  # fmt: skip
    whole = pd.DataFrame({"pairs": [len(pairs)], "measured": [pairs["measured"].median()],
                          "predicted": [pairs["predicted"].median()]}, index=["all"])  # fmt: skip
    return pd.concat([per, whole]).round(3)


def errors(rows: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Per (source, precision, amp): rows, MAPE % and median measured / predicted."""
    ratio = rows["target_ms"] / rows[baseline]
    frame = rows.assign(ape=100 * (1 / ratio - 1).abs(), ratio=ratio)
    keys = ["source", "precision", "amp"]
    return frame.groupby(keys).agg(rows=("ape", "size"), mape=("ape", "mean"),
                                   measured_over_predicted=("ratio", "median")).round(3)  # fmt: skip


def main(cfg: dict[str, Any] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    from data_collection.schema import load_steps

    cfg = {"timm_models": 150, "seed": 0, **(cfg or {})}
    ds = build_dataset(load_steps(), cfg, per_op="per-op", verbose=False)
    timm = ds.rows[ds.rows["source"] == "timm_train"]
    ratios = summary(paired_ratios(timm))
    print("timm AMP training on an RTX 3090: NHWC / NCHW step time, median per family")
    print(ratios.to_string())
    plain = ds.with_per_op("per-op", WithoutTransforms(load_heads()))
    both = errors(ds.rows, "baseline_ms").merge(
        errors(plain.rows, "baseline_ms"), left_index=True, right_index=True,
        suffixes=("", " without transforms"),
    )  # fmt: skip
    print("\nSum of per-op times on every step row, with the transforms and without them")
    print(both.to_string())
    return ratios, both


if __name__ == "__main__":
    from boom_ml.config_help import doc_help_or_no_args, one_line_errors

    if not doc_help_or_no_args(__doc__):
        with one_line_errors():
            main()
