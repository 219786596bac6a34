"""timm (pytorch-image-models) benchmark CSVs: AMP training on an RTX 3090, and inference.

See ``timm_bench/SOURCE.md``. Training step = forward, CrossEntropyLoss, backward and
``optimizer.step()`` (timm ``sgd``) under FP16 autocast, input already on the GPU;
``train_step_time`` is the **mean** ms per step; the batch is the largest of 512, 384, 256,
... that fitted in 24 GB. Inference is forward only under ``torch.no_grad``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from data_collection.importers.common import (
    GpuResolver,
    ImportResult,
    Progress,
    cuda_from_tag,
    require_file,
    torch_from_tag,
)

NAME = "timm_bench"
TRAIN_FILES = (
    "benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv",
    "benchmark-train-amp-nhwc-pt112-cu113-rtx3090.csv",
)
FILE_RE = re.compile(
    r"^benchmark-(?P<phase>train|infer)-(?P<prec>amp|amp_bf16|bf16)-(?P<layout>nchw|nhwc)"
    r"-(?P<pt>pt\d+)-(?P<cu>cu\d+)-(?P<gpu>[a-z0-9]+?)(?P<dynamo>-dynamo)?\.csv(?:\.gz)?$"
)
# File-name GPU tags -> the device string handed to the GPU database.
GPU_NAMES = {
    "rtx3090": "NVIDIA GeForce RTX 3090",
    "rtx4090": "NVIDIA GeForce RTX 4090",
    "4090": "NVIDIA GeForce RTX 4090",
    "5090": "NVIDIA GeForce RTX 5090",
    "pro6000maxq": "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
}
# (precision of the weights, autocast mode) per file-name precision tag.
PRECISION = {
    "amp": ("float32", "fp16"),
    "amp_bf16": ("float32", "bf16"),
    "bf16": ("bfloat16", "none"),
}
TRAIN_NOTE = (
    "timm benchmark.py: random input on the GPU, forward, CrossEntropyLoss, backward, "
    "optimizer.step() (sgd, lr 1e-4); batch = largest that fitted in 24 GB from 512, 384, "
    "256, 192, 128, 96, 64, 32, ..."
)


def _frame(path: Path, rel: str, gpu: GpuResolver, result: ImportResult) -> pd.DataFrame:
    m = FILE_RE.match(path.name)
    if not m:
        raise ValueError(f"{path}: timm benchmark file name does not parse")
    train = m["phase"] == "train"
    prefix = "train" if train else "infer"
    raw = pd.read_csv(path)
    # A few rows hold a model name but no time or batch (the benchmark produced nothing for
    # them, cause not recorded); they are not measurements, so they are excluded, loudly.
    empty = raw[f"{prefix}_step_time"].isna()
    if empty.any():
        result.note(
            f"{rel}: excluded {int(empty.sum())} row(s) with no measured time: "
            + ", ".join(raw.loc[empty, "model"].astype(str))
        )
        raw = raw[~empty].reset_index(drop=True)
    # The pt210 files write batch sizes as floats ("1024.0"); anything fractional is an error.
    batch = pd.to_numeric(raw[f"{prefix}_batch_size"], errors="raise")
    if (batch % 1 != 0).any():
        raise ValueError(f"{path}: fractional batch size {batch[batch % 1 != 0].iloc[0]}")
    device = GPU_NAMES[m["gpu"]]
    precision, amp = PRECISION[m["prec"]]
    return pd.DataFrame(
        {
            "source": "timm_train" if train else "timm_infer",
            "gpu_id": gpu(device),
            "device_name": device,
            "device_kind": "gpu",
            "num_gpus": 1,
            "model": "timm:" + raw["model"].astype(str),
            "model_family": _family(raw["model"]),
            "batch_size": batch.astype("int64"),
            "global_batch_size": batch.astype("int64"),
            "image_size": raw[f"{prefix}_img_size"],
            "precision": precision,
            "amp": amp,
            "checkpointing": "none",
            "optimizer": "sgd" if train else "none",
            "tf32": None,  # not set by the script; the PyTorch defaults differ by version
            "channels_last": m["layout"] == "nhwc",
            "phase_scope": "fwd+bwd+opt" if train else "fwd",
            "step_time_ms": raw[f"{prefix}_step_time"],
            "step_time_stat": "mean",
            "oom": False,
            "torch_version": torch_from_tag(m["pt"]),
            "cuda_version": cuda_from_tag(m["cu"]),
            "variant": "dynamo" if m["dynamo"] else "",
            "run_id": path.name,
            "source_path": rel,
            "notes": TRAIN_NOTE if train else "forward only under torch.no_grad",
        }
    )


def _family(models: pd.Series) -> pd.Series:
    # timm mixes CNNs, vision transformers and MLP models; the name is the only signal the
    # CSV gives, so this is a coarse, name-based tag (attention families -> transformer,
    # MLP-only families -> other, everything else -> cnn), not a measured property.
    names = models.astype(str)
    vit = names.str.match(
        r"^(vit|deit|beit|swin|cait|xcit|levit|crossvit|pit_|tnt|twins|convit|coat|mvit|"
        r"eva|maxvit|maxxvit|efficientformer|volo|gcvit|davit|flexivit|hiera|mobilevit|"
        r"nest|jx_nest|pvt|samvit|vitamin|fastvit|tiny_vit|nextvit|efficientvit)"
    )
    mlp = names.str.match(r"^(mixer|resmlp|gmlp|sequencer)")
    family = pd.Series("cnn", index=models.index)
    family[vit] = "transformer"
    family[mlp] = "other"
    return family


def run(shared: Path, gpu: GpuResolver, progress: Progress) -> ImportResult:
    result = ImportResult()
    folder = shared / NAME
    for name in TRAIN_FILES:
        path = require_file(folder / name)
        result.add("steps", "timm_train", _frame(path, f"{NAME}/{name}", gpu, result))
        progress()
    infer = sorted((folder / "infer").glob("benchmark-infer-*.csv.gz"))
    if not infer:
        raise FileNotFoundError(f"no inference benchmark files under {folder / 'infer'}")
    for path in infer:
        result.add("steps", "timm_infer", _frame(path, f"{NAME}/infer/{path.name}", gpu, result))
        progress()
    return result


def n_steps(shared: Path) -> int:
    return len(TRAIN_FILES) + len(list((shared / NAME / "infer").glob("benchmark-infer-*.csv.gz")))
