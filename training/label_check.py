"""NeuSight's whole-model training labels against NeuSight's own per-op timings of the same step.

    python -m training.label_check

Each NeuSight training label (``../shared/data/neusight/labels``) has a forward and a
backward latency for the whole model, and, for most, a CSV timing every op of a one-layer
copy of it (``op_profiles/neusight_labels``). The whole model is the non-layer ops plus
``num_layer`` times the layer's ops; this prints, per label, both passes as labelled and as
that sum implies, and their ratio. A ratio far from 1 is in the labels themselves: no
per-op model (ours or NeuSight's) can reach such a label by summing ops. No model is used.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from data_collection.paths import shared_data_dir

# Module names of a transformer's first block in NeuSight's FX node names (GPT-2 ``h_0``,
# BERT ``layer_0``, OPT ``layers_0``); the layer is every node between its first and last.
LAYER_0 = r"(?:^|_)(?:h|layer|layers|block)_0_"


def layer_sums(ops: pd.DataFrame, num_layer: int) -> tuple[float, float]:
    """(forward, backward) ms of the whole model from one profiled layer's ops."""
    ops = ops.sort_values("node_index")
    marked = ops["node_name"].astype(str).str.contains(LAYER_0, regex=True)
    if not marked.any():
        raise ValueError("no node of the first layer")
    first, last = ops.loc[marked, "node_index"].min(), ops.loc[marked, "node_index"].max()
    inside = ops["node_index"].between(first, last)
    fw = ops.loc[~inside, "fw_ms"].sum() + num_layer * ops.loc[inside, "fw_ms"].sum()
    bw = ops.loc[~inside, "bw_ms"].sum() + num_layer * ops.loc[inside, "bw_ms"].sum()
    return float(fw), float(bw)


def label_table(profiles: pd.DataFrame, index: pd.DataFrame) -> pd.DataFrame:
    """One line per training label with a per-op CSV: labelled and summed passes, ratios."""
    train = index[index["mode"] == "train"].set_index(["gpu_folder", "json_file"])
    out = []
    for key, ops in profiles[profiles["phase_scope"] != "fwd"].groupby("step_key", sort=True):
        folder, name = str(key).split("/", 1)
        if (folder, f"{name}.json") not in train.index:
            continue
        label = train.loc[(folder, f"{name}.json")]
        fw, bw = layer_sums(ops, int(label["num_layer"]))
        out.append({"gpu": folder, "label": name, "fw_label": label["fw_latency_ms"],
                    "fw_ops": fw, "bw_label": label["bwall_latency_ms"], "bw_ops": bw})  # fmt: skip
    table = pd.DataFrame(out)
    table["fw_ratio"] = table["fw_label"] / table["fw_ops"]
    table["bw_ratio"] = table["bw_label"] / table["bw_ops"]
    table["step_ratio"] = (table["fw_label"] + table["bw_label"]) / (
        table["fw_ops"] + table["bw_ops"]
    )
    return table


def main(data_dir: str | Path | None = None) -> pd.DataFrame:
    from data_collection.schema import load_op_profiles

    profiles = load_op_profiles(data_dir, sources=["neusight_labels"])
    index = pd.read_csv(shared_data_dir() / "neusight" / "labels_index.csv")
    table = label_table(profiles, index)
    print(table.round(2).to_string(index=False))
    print("\nThe ops' sum as a prediction of each whole-step label, per GPU (MAPE %):")
    print(ops_sum_mape(table).round(1).to_string())
    return table


def ops_sum_mape(table: pd.DataFrame) -> pd.Series:
    """Per GPU: the mean |ops' sum / label - 1| over its labels, in % (1 - 1 / step_ratio)."""
    ape = 100 * (1 / table["step_ratio"] - 1).abs()
    return ape.groupby(table["gpu"]).mean().rename("ops_sum_mape")


if __name__ == "__main__":
    from boom_ml.config_help import doc_help_or_no_args, one_line_errors

    if not doc_help_or_no_args(__doc__):
        with one_line_errors():
            main()
