"""torchvision CNN training-step times (ryujaehun/pytorch-gpu-benchmark).

See ``cnn_step_times/SOURCE.md``: each raw value is one timed iteration in ms; a step is
forward + CrossEntropyLoss + backward with **no optimizer**; batch 12 per GPU at 224x224;
``half`` is a pure ``.half()`` model (not AMP); 2-4 GPUs use ``nn.DataParallel``. We keep
one row per (file, model): the median over its 50 (2020 script) or 20 (2018) iterations,
with the inter-quartile range as spread.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from data_collection.importers.common import GpuResolver, ImportResult, Progress, require_file

NAME = "cnn_step_times"
FILE = "cnn_train_step_times_long.csv.gz"
KEYS = ["gpu", "num_gpus", "precision", "model", "script_version", "card_index", "source_path"]
PRECISIONS = {"float": "float32", "half": "float16", "double": "float64"}
PER_GPU_BATCH = 12

# Software stated by the benchmark's README for some folders (SOURCE.md table); others: unknown.
SOFTWARE = {
    "results/dgx-a100/": ("11.1", "8.0.4"),  # NGC 20.10 container, cuDNN 8004
    "results/TitanRTX/": ("10.2", None),
    "results/2080ti(2)/": ("10.0", "7.6.0"),  # cuDNN 7600
}
NOTES = {
    "2020": (
        "5 warm-up + timed steps; step = zero_grad, host-to-device copy of the batch, "
        "forward, CrossEntropyLoss, backward; no optimizer step; cudnn.benchmark=True"
    ),
    "2018": "timed steps of forward, loss, backward with the input already on the GPU; "
    "no optimizer step",
}


def _software(path: str) -> tuple[str | None, str | None]:
    for prefix, versions in SOFTWARE.items():
        if path.startswith(prefix):
            return versions
    return None, None


def _tf32(gpu_name: str, precision: str) -> bool | None:
    # Only Ampere (the A100 here) has TF32; PyTorch >= 1.7 enabled it for cuDNN by default,
    # so whether A100 float convolutions used it is unknown rather than False.
    if precision != "float32":
        return False
    return None if "A100" in gpu_name else False


def aggregate(raw: pd.DataFrame) -> pd.DataFrame:
    """Median, IQR and count of ``step_time_ms`` per raw (file, model) group."""
    raw = raw.copy()
    raw["t"] = pd.to_numeric(raw["step_time_ms"], errors="raise")
    grouped = raw.groupby(KEYS, sort=True, dropna=False)["t"]
    agg = grouped.agg(
        median="median",
        q25=lambda s: s.quantile(0.25),
        q75=lambda s: s.quantile(0.75),
        count="count",
    )
    return agg.reset_index()


def run(shared: Path, gpu: GpuResolver, progress: Progress) -> ImportResult:
    result = ImportResult()
    raw = pd.read_csv(require_file(shared / NAME / FILE), dtype=str, keep_default_na=False)
    progress()
    batches = raw["global_batch_size"].astype(int) != PER_GPU_BATCH * raw["num_gpus"].astype(int)
    if batches.any():
        raise ValueError(
            f"{NAME}: global_batch_size is not 12 x num_gpus in row {batches.idxmax()}"
        )
    agg = aggregate(raw)
    progress()
    num_gpus = agg["num_gpus"].astype(int)
    precision = agg["precision"].map(PRECISIONS)
    if precision.isna().any():
        raise ValueError(
            f"{NAME}: unknown precision {agg['precision'][precision.isna()].iloc[0]!r}"
        )
    software = agg["source_path"].map(_software)
    multi = num_gpus > 1
    df = pd.DataFrame(
        {
            "source": NAME,
            "gpu_id": gpu.map(agg["gpu"]),
            "device_name": agg["gpu"],
            "device_kind": "gpu",
            "num_gpus": num_gpus,
            "model": "torchvision:" + agg["model"],
            "model_family": "cnn",
            "batch_size": PER_GPU_BATCH,
            "global_batch_size": PER_GPU_BATCH * num_gpus,
            "seq_len": None,
            "image_size": 224,
            "precision": precision,
            "amp": "none",
            "checkpointing": "none",
            "optimizer": "none",
            "tf32": [_tf32(g, p) for g, p in zip(agg["gpu"], precision, strict=True)],
            "channels_last": False,
            "phase_scope": "fwd+bwd",
            "step_time_ms": agg["median"],
            "step_time_stat": "median",
            "step_time_spread_ms": agg["q75"] - agg["q25"],
            "step_time_spread_stat": "iqr",
            "n_iterations": agg["count"],
            "oom": False,
            "cuda_version": software.str[0],
            "cudnn_version": software.str[1],
            "variant": multi.map({True: "dataparallel", False: ""}),
            "run_id": "script"
            + agg["script_version"]
            + agg["card_index"].map(lambda c: f"-card{c}" if c else ""),
            "source_path": agg["source_path"],
            "notes": agg["script_version"].map(NOTES)
            + multi.map({True: "; nn.DataParallel, batch 12 per GPU", False: ""}),
        }
    )
    if df["gpu_id"].isna().any():
        raise ValueError(
            f"{NAME}: non-NVIDIA device in a CUDA benchmark: {df['device_name'][df['gpu_id'].isna()].iloc[0]}"
        )
    result.add("steps", NAME, df)
    result.note(f"{NAME}: {len(raw)} timed iterations aggregated into {len(df)} (file, model) rows")
    return result


def n_steps(shared: Path) -> int:
    return 2
