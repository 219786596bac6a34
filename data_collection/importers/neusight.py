"""NeuSight (sitar-lab/NeuSight): per-op kernels, whole-model labels, per-node layer traces.

See ``neusight/SOURCE.md``: per-op tables are FP32, forward only (``torch.no_grad``), TF32
off, latency in ms as the mean of the fastest 5 of 25 CUDA-event timings, PyTorch 2.1.0 /
CUDA 12.1 / cuDNN 8902 on every row. Labels are whole-model FP32 runs; ``train`` is forward
plus ``loss.backward()`` with no optimizer step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from boom_ml.ops_csv import SCALAR_OPS
from data_collection.importers.common import (
    GpuResolver,
    ImportResult,
    Progress,
    cuda_from_tag,
    cudnn_from_int,
    nonzero_or_none,
    require_file,
    torch_from_tag,
)

NAME = "neusight"
LATENCY_STAT = "mean_fastest5_of_25"

# NeuSight op name -> (canonical op, family). The ``u`` ops take a Python scalar operand.
OPS: dict[str, tuple[str, str]] = {
    "bmm": ("bmm", "gemm"),
    "linear": ("linear", "gemm"),
    "conv": ("conv2d", "conv"),
    "ln": ("layer_norm", "norm"),
    "softmax": ("softmax", "softmax"),
    **{o: (o, "elementwise") for o in ("add", "mul", "div", "pow", "relu", "gelu", "tanh")},
    **{name: (op, "elementwise") for name, op in SCALAR_OPS.items()},
}
TRAIN_FILES = ("bmm", "linear", "conv", "ln", "softmax", "add", "addu", "div", "divu",
               "gelu", "mul", "mulu", "pow", "powu", "relu", "tanh")  # fmt: skip
TEST_FILES = ("bmm", "linear", "elem", "ln", "softmax")

# Label model names -> boom_ml model specs. Names without a published Hugging Face id point
# at the config JSON shipped with the data (path relative to the shared data dir).
MODEL_SPECS = {
    "bert": "hf:bert-base-uncased",
    "bert_large": "hf:bert-large-uncased",
    "gpt2_med": "hf:gpt2-medium",
    "gpt2_large": "hf:gpt2-large",
    "gpt2_xl": "hf:gpt2-xl",
    "opt_13": "hf:facebook/opt-1.3b",
}
LABEL_RE = re.compile(r"^(?P<model>.+?)-(?P<mode>inf|train)-(?P<seq>\d+)-(?P<batch>\d+)(?:-(?P<variant>.+))?$")  # fmt: skip
# TF32 exists only from Ampere on; on older cards FP32 can only be FP32.
PRE_AMPERE = ("P4", "P100", "T4", "V100")


def _kernel_frame(raw: pd.DataFrame, split: str, gpu: GpuResolver) -> tuple[pd.DataFrame, int]:
    """Canonical kernel rows for one NeuSight CSV; returns (rows, skipped non-NVIDIA rows)."""
    op_family = raw["OPName"].map(OPS)
    unknown = raw.loc[op_family.isna(), "OPName"]
    if len(unknown):
        raise ValueError(f"neusight: unknown OPName {unknown.iloc[0]!r}")
    gpu_ids = gpu.map(raw["Device"])
    keep = gpu_ids.notna()
    raw, gpu_ids, op_family = raw[keep], gpu_ids[keep], op_family[keep]
    df = pd.DataFrame(index=raw.index)
    df["source"] = f"neusight_{split}"
    df["split"] = split
    df["gpu_id"] = gpu_ids
    df["device_name"] = raw["Device"]
    df["device_kind"] = "gpu"
    df["op"] = op_family.str[0]
    df["family"] = op_family.str[1]
    df["dtype"] = "float32"
    df["direction"] = "forward"
    cols = set(raw.columns)
    if {"M", "N", "K"} <= cols:  # bmm (B,M,N)x(B,N,K); linear Linear(N->K) on (B,M,N)
        for c in ("B", "M", "N", "K"):
            df[c.lower()] = raw[c]
    elif "Input_Channel" in cols:  # Conv2d(bias=False) on a square (B, C, S, S) input
        df["batch"] = raw["B"]
        df["in_channels"] = raw["Input_Channel"]
        df["out_channels"] = raw["Output_Channel"]
        df["kernel_size"] = df["kernel_w"] = raw["Kernel_Szie"]
        df["input_h"] = df["input_w"] = raw["Input_Size"]
        df["stride"] = df["stride_w"] = raw["Stride"]
        df["padding"] = df["padding_w"] = raw["Padding"]
    else:  # vector ops on a (B, H) tensor; numel is that of one operand (= the output)
        df["rows"] = raw["B"]
        df["cols"] = raw["H"]
        df["numel"] = raw["B"].astype("int64") * raw["H"].astype("int64")
    df["latency_ms"] = raw["Latency"]
    df["latency_stat"] = LATENCY_STAT
    df["n_repeats"] = 25
    df["torch_version"] = raw["Torch Version"].map(torch_from_tag)
    df["cuda_version"] = raw["CUDA Version"].map(cuda_from_tag)
    df["cudnn_version"] = raw["CUDNN Version"].map(cudnn_from_int)
    if "Kernels" in cols:  # ';'-joined list of every kernel launched, with a leading ';'
        listed = raw["Kernels"].fillna("").str.strip(";")
        df["kernel_names"] = listed.where(listed != "", raw["Kernel Name"])
    else:
        df["kernel_names"] = raw["Kernel Name"]
    return df, int((~keep).sum())


def _read(path: Path) -> pd.DataFrame:
    return pd.read_csv(require_file(path), low_memory=False)


def import_kernels(
    shared: Path, result: ImportResult, gpu: GpuResolver, progress: Progress
) -> None:
    for split, folder, files in (
        ("train", "ops_train", TRAIN_FILES),
        ("test", "ops_test", TEST_FILES),
    ):
        for name in files:
            frame, skipped = _kernel_frame(
                _read(shared / NAME / folder / f"{name}.csv.gz"), split, gpu
            )
            result.add("kernels", f"neusight_{split}", frame)
            result.skip("kernels", skipped)
            progress()


def _device_name(shared: Path, folder: str) -> str:
    """The device string NeuSight's own device config gives for a label folder."""
    cfg = shared / NAME / "device_configs" / f"{folder}.json"
    if cfg.exists():
        return json.loads(cfg.read_text())["Device"]
    return folder.replace("_", " ")


def _model_spec(shared: Path, model: str) -> str | None:
    if model in MODEL_SPECS:
        return MODEL_SPECS[model]
    cfg = Path(NAME) / "model_configs" / f"{model}.json"
    return f"hf:{cfg.as_posix()}" if (shared / cfg).exists() else None


def import_labels(shared: Path, result: ImportResult, gpu: GpuResolver, progress: Progress) -> None:
    """Whole-model latency labels -> steps; their per-node layer traces -> op_profiles."""
    steps, profiles = [], []
    no_config: list[str] = []
    root = shared / NAME / "labels"
    for folder in sorted(p.name for p in root.iterdir() if p.is_dir()):
        device = _device_name(shared, folder)
        gpu_id = gpu(device)
        for path in sorted((root / folder).glob("*.json")):
            m = LABEL_RE.match(path.stem)
            if not m:
                raise ValueError(f"{path}: label file name does not parse")
            trace = path.with_suffix(".csv")
            if gpu_id is None:
                result.skip("steps", 1)
                if trace.exists():
                    result.skip("op_profiles", len(pd.read_csv(trace, usecols=["op"])))
                continue
            spec = _model_spec(shared, m["model"])
            if spec is None:
                rows = len(pd.read_csv(trace, usecols=["op"])) if trace.exists() else 0
                no_config.append(f"{folder}/{path.name} (+{rows} trace rows)")
                continue
            rec = json.loads(path.read_text())
            train = m["mode"] == "train"
            variant = m["variant"] or ""
            nodes = 4 if re.fullmatch(r"(dp|tp|pp)4(_\d+)?", variant) else 1
            row = {
                "source": "neusight_labels",
                "gpu_id": gpu_id,
                "device_name": device,
                "device_kind": "gpu",
                "num_gpus": nodes,
                "model": spec,
                "model_family": "transformer",
                "batch_size": int(m["batch"]),
                "global_batch_size": int(m["batch"]),
                "seq_len": int(m["seq"]),
                "precision": "float32",
                "amp": "none",
                "checkpointing": "none",
                "optimizer": "none",
                "tf32": False if any(g in device for g in PRE_AMPERE) else None,
                "channels_last": False,
                "phase_scope": "fwd+bwd" if train else "fwd",
                "step_time_ms": rec["e2e_latency"],
                "step_time_stat": LATENCY_STAT,
                "n_iterations": 25,
                # 0 in the JSON means "not recorded" (distributed runs) or "no backward" (inf).
                "fw_ms": nonzero_or_none(rec["fw_latency"]),
                "bw_ms": nonzero_or_none(rec["bwall_latency"]) if train else None,
                "oom": False,
                "variant": variant,
                "run_id": f"{folder}/{path.stem}",
                "source_path": f"{NAME}/labels/{folder}/{path.name}",
                "notes": _label_note(variant),
            }
            steps.append(row)
            if trace.exists():
                profiles.append(_profile(trace, row))
        progress()
    result.add("steps", "neusight_labels", pd.DataFrame(steps))
    if profiles:
        result.add("op_profiles", "neusight_labels", pd.concat(profiles, ignore_index=True))
    if no_config:
        result.note(
            f"neusight_labels: excluded {len(no_config)} label(s) whose model has no config "
            f"shipped (so no model spec can be written): {', '.join(no_config)}"
        )


def _label_note(variant: str) -> str | None:
    if variant == "fusion":
        return "inference under torch.compile"
    if variant:
        return (
            f"Megatron {variant} run on 4 GPUs, e2e latency only; the file name's batch "
            "is copied to both batch columns (per-GPU vs global is not stated)"
        )
    return None


def _profile(path: Path, step: dict) -> pd.DataFrame:
    """One per-node FX trace (a model built with a single transformer layer)."""
    raw = pd.read_csv(path, low_memory=False)
    # One header variant writes e2e/bwall instead of latency; the totals mean the same.
    total = raw["latency"] if "latency" in raw.columns else raw["e2e_latency"]
    out = pd.DataFrame(
        {
            "node_index": range(len(raw)),
            "node_name": raw["Name"],
            "node_kind": raw["op"],
            "op": raw["target"].astype(str),
            "input_shapes": raw["input_shapes"],
            "output_shape": raw["output_shape"],
            "dtype": raw["dtype"],
            "duration_ms": total,
            "fw_ms": raw["fw_latency"],
            "bw_ms": raw["bw_latency"],
            "acc_ms": raw["acc_latency"],
        }
    )
    for key in ("source", "gpu_id", "device_name", "device_kind", "model", "batch_size",
                "seq_len", "phase_scope", "variant"):  # fmt: skip
        out[key] = step[key]
    out["step_key"] = step["run_id"]
    out["image_size"] = None
    out["kernel_names"] = None
    out["scope"] = "model_with_1_layer"
    return out


def run(shared: Path, gpu: GpuResolver, progress: Progress) -> ImportResult:
    result = ImportResult()
    import_kernels(shared, result, gpu, progress)
    import_labels(shared, result, gpu, progress)
    return result


def n_steps(shared: Path) -> int:
    """Progress-bar length: one tick per CSV and per label folder."""
    labels = shared / NAME / "labels"
    folders = sum(p.is_dir() for p in labels.iterdir()) if labels.exists() else 0
    return len(TRAIN_FILES) + len(TEST_FILES) + folders
