"""xMem peak-memory runs on an RTX 3060 (Stone-ResearchLife/xMem), one row per run.

See ``memory/SOURCE.md``: FP32 training, 4 optimiser steps; ground truth is the NVML-sampled
maximum of used device memory minus the first sample; when ``real_oom`` is true it sits near
the 12.6 GB capacity and is not a true peak. The four estimators' predictions are kept so
that reports can print them beside ours.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from data_collection.importers.common import GpuResolver, ImportResult, Progress, require_file

NAME = "xmem"
FILE = Path("memory") / "xmem_rtx3060_runs.csv"
# xMem model names -> (boom_ml model spec, family, num_classes). The torchvision CNNs are
# built with weights=None; MobileNetV3/MNASNet with num_classes=10, the others with 1000.
MODELS: dict[str, tuple[str, str, int | None]] = {
    "ConvNeXtBase": ("torchvision:convnext_base", "cnn", 1000),
    "ConvNeXtTiny": ("torchvision:convnext_tiny", "cnn", 1000),
    "MnasNet": ("torchvision:mnasnet1_0", "cnn", 10),
    "MobeNetV3Large": ("torchvision:mobilenet_v3_large", "cnn", 10),  # (sic) in xMem
    "EleutherAI/gpt-neo-125M": ("hf:EleutherAI/gpt-neo-125M", "transformer", None),
    "T5-small": ("hf:t5-small", "transformer", None),
    "cerebras/Cerebras-GPT-111M": ("hf:cerebras/Cerebras-GPT-111M", "transformer", None),
    "distilbert/distilgpt2": ("hf:distilbert/distilgpt2", "transformer", None),
}
OPTIMIZERS = {
    "Adagrad": "adagrad",
    "Adam": "adam",
    "AdamW": "adamw",
    "RMSprop": "rmsprop",
    "SGD": "sgd",
}
ESTIMATORS = {"solution": "xmem", "DNNmem": "dnnmem", "SchedTune": "schedtune", "LLmem": "llmem"}
GROUND_TRUTH = "NVML max(sampled used memory) - first sample, over 4 optimiser steps"
SEQ_NOTE = "dynamic padding to the longest sequence in each batch, at most 128 tokens"


def _bool(s: pd.Series) -> pd.Series:
    return s.map({"true": True, "false": False, "": None})


def run(shared: Path, gpu: GpuResolver, progress: Progress) -> ImportResult:
    result = ImportResult()
    raw = pd.read_csv(require_file(shared / FILE), dtype=str, keep_default_na=False)
    progress()
    unknown = set(raw["model"]) - set(MODELS)
    if unknown:
        raise ValueError(f"{NAME}: unmapped model name(s) {sorted(unknown)}")
    unknown = set(raw["optimiser"]) - set(OPTIMIZERS)
    if unknown:
        raise ValueError(f"{NAME}: unmapped optimiser(s) {sorted(unknown)}")
    spec = raw["model"].map(MODELS)
    cnn = spec.str[1] == "cnn"
    sizes = raw["input_size"].str.extract(r"^(\d+)x(\d+)x\d+$")
    if (sizes[0] != sizes[1]).any() or sizes[0].isna().any():
        raise ValueError(f"{NAME}: unexpected input_size {raw['input_size'].iloc[0]!r}")
    df = pd.DataFrame(
        {
            "source": NAME,
            "gpu_id": gpu.map(raw["gpu_name"]),
            "device_name": raw["gpu_name"],
            "device_kind": "gpu",
            "model": spec.str[0],
            "model_family": spec.str[1],
            "num_classes": spec.str[2],
            "optimizer": raw["optimiser"].map(OPTIMIZERS),
            "batch_size": raw["batch_size"],
            "image_size": sizes[0].where(cnn),  # input_size applies to the CNNs only
            "seq_len": pd.Series(128, index=raw.index).where(~cnn),
            "seq_len_note": pd.Series(SEQ_NOTE, index=raw.index).where(~cnn),
            "precision": "float32",
            "amp": "none",
            "phase_scope": "fwd+bwd+opt",
            "n_optimizer_steps": raw["target_iteration"].astype(int) + 1,
            "ground_truth_peak_bytes": raw["ground_truth_peak_bytes"],
            "ground_truth_method": GROUND_TRUTH,
            "real_oom": _bool(raw["real_oom"]),
            "capacity_bytes": raw["total_gpu_memory"],
            "experiment": raw["experiment"],
            "subfolder": raw["subfolder"],
            "run_id": raw["run_id"],
            "source_path": raw["source_path"],
            "notes": "when real_oom is true the ground truth sits near capacity, not a true peak",
        }
    )
    for tool, ours in ESTIMATORS.items():
        mem = pd.to_numeric(raw[f"{tool}_memory_bytes"].replace("", None), errors="raise")
        failed = mem == -1  # LLmem writes -1 when it could not estimate (T5-small)
        present = _bool(raw[f"{tool}_present"]).fillna(False).astype(bool)
        df[f"{ours}_memory_bytes"] = mem.where(present & ~failed)
        df[f"{ours}_oom"] = _bool(raw[f"{tool}_oom"]).where(present & ~failed)
        err = pd.to_numeric(raw[f"{tool}_error"].replace("", None), errors="raise")
        df[f"{ours}_error"] = err.where(present & ~failed)
        if ours == "llmem":
            df["llmem_failed"] = failed.fillna(False)
        elif failed.any():
            raise ValueError(f"{NAME}: {tool} reports -1 bytes, only LLmem is known to")
    result.add("memory", NAME, df)
    return result


def n_steps(shared: Path) -> int:
    return 1
