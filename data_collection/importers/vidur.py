"""Vidur MLP-block operator profiles (microsoft/vidur) on A100 and A40.

See ``vidur/SOURCE.md`` and vidur's ``profiling/mlp/mlp_impl.py``: FP16, forward only under
``torch.inference_mode``; each operator's CUDA kernel time in ms, with min/max/mean/median/std
over 20 active steps; one GPU runs the 1/TP shard of a layer on ``num_tokens`` tokens.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from data_collection.importers.common import GpuResolver, ImportResult, Progress

NAME = "vidur"
# Vidur's folders say only "a100"/"a40". Vidur's own device config models the A100 as the
# 80 GB part and its default network SKU is "a100_pairwise_nvlink" (PCIe cards bridged in
# pairs, as on Azure NC A100 v4), so the 80 GB PCIe card is our best reading; the repository
# does not state it. Single-GPU operator times do not depend on the interconnect.
GPU_NAMES = {"a100": "NVIDIA A100 80GB PCIe", "a40": "NVIDIA A40"}
# Norm per model family, from vidur's model configs; post_attention_layernorm exists only for
# RMSNorm models there, which the CSV columns let us cross-check.
LAYER_NORM_MODELS = {"microsoft/phi-2"}
OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")  # fmt: skip


def _shapes(op: str, cfg: pd.DataFrame, model: str) -> dict[str, object]:
    """Canonical op, family and shape columns of one vidur operator (vectorised over rows)."""
    tokens = cfg["num_tokens"]
    tp = cfg["num_tensor_parallel_workers"]
    embd, heads, kv = cfg["n_embd"], cfg["n_head"], cfg["n_kv_head"]
    head_dim = embd // heads
    hidden = cfg["n_expanded_embd"]
    gated = cfg["use_gated_mlp"]

    def linear(n: pd.Series, k: pd.Series) -> dict[str, object]:
        # NeuSight convention: Linear(n -> k) on a (b, m, n) input; tokens are the m rows.
        return {"op": "linear", "family": "gemm", "b": 1, "m": tokens, "n": n, "k": k}

    def rowwise(name: str, family: str, cols: pd.Series) -> dict[str, object]:
        return {"op": name, "family": family, "rows": tokens, "cols": cols, "numel": tokens * cols}

    norm = "layer_norm" if model in LAYER_NORM_MODELS else "rms_norm"
    if op == "emb":  # VocabParallelEmbedding: a (tokens,) lookup into vocab/TP rows
        return rowwise("embedding", "embedding", embd)
    if op in ("input_layernorm", "post_attention_layernorm"):
        return rowwise(norm, "norm", embd)
    if op == "attn_pre_proj":  # column-parallel QKV projection
        return linear(embd, (heads + 2 * kv) * head_dim // tp)
    if op == "attn_rope":  # rotary embedding applied to this worker's q and k heads
        out = rowwise("rotary_embedding", "elementwise", (heads + kv) // tp * head_dim)
        return {**out, "heads": (heads + kv) // tp, "head_dim": head_dim}
    if op == "attn_post_proj":  # row-parallel output projection
        return linear(heads * head_dim // tp, embd)
    if op == "mlp_up_proj":  # gated MLPs project to 2 x hidden (gate and up together)
        return linear(embd, hidden * gated.map({True: 2, False: 1}) // tp)
    if op == "mlp_act":  # SiluAndMul (gated) halves the width; GELU keeps it
        name = "silu_and_mul" if bool(gated.iloc[0]) else "gelu"
        return rowwise(name, "elementwise", hidden // tp)
    if op == "mlp_down_proj":
        return linear(hidden // tp, embd)
    if op == "add":  # residual add; without a post-attention norm it is attn + mlp + residual
        return rowwise("add" if norm == "rms_norm" else "add3", "elementwise", embd)
    raise ValueError(f"vidur: unknown operator {op!r}")


def _frame(path: Path, gpu_folder: str, model: str, gpu: GpuResolver) -> pd.DataFrame:
    raw = pd.read_csv(path)
    if raw["use_gated_mlp"].nunique() != 1:
        raise ValueError(f"{path}: use_gated_mlp varies within one model")
    has_post = "time_stats.post_attention_layernorm.median" in raw.columns
    if has_post == (model in LAYER_NORM_MODELS):
        raise ValueError(f"{path}: post_attention_layernorm presence contradicts the norm table")
    bad = (raw["n_embd"] % raw["n_head"] != 0) | (
        raw["n_head"] % raw["num_tensor_parallel_workers"] != 0
    )
    if bad.any():
        raise ValueError(
            f"{path} row {int(bad.to_numpy().nonzero()[0][0])}: heads do not split over TP"
        )
    device = GPU_NAMES[gpu_folder]
    frames = []
    for op in OPS:
        stat = f"time_stats.{op}"
        if f"{stat}.median" not in raw.columns:
            continue
        df = pd.DataFrame(_shapes(op, raw, model), index=raw.index)
        df["latency_ms"] = raw[f"{stat}.median"]
        df["latency_spread_ms"] = raw[f"{stat}.std"]
        df["context"] = (
            f"model={model} vidur_op={op} tp="
            + raw["num_tensor_parallel_workers"].astype(str)
            + (
                " vocab_rows="
                + (raw["vocab_size"] // raw["num_tensor_parallel_workers"]).astype(str)
                if op == "emb"
                else ""
            )
        )
        frames.append(df)
    out = pd.concat(frames, ignore_index=True)
    out["source"] = NAME
    out["split"] = ""
    out["gpu_id"] = gpu(device)
    out["device_name"] = gpu_folder
    out["device_kind"] = "gpu"
    out["dtype"] = "float16"
    out["direction"] = "forward"
    out["latency_stat"] = "median"
    out["latency_spread_stat"] = "std"
    out["n_repeats"] = 20
    return out


def run(shared: Path, gpu: GpuResolver, progress: Progress) -> ImportResult:
    result = ImportResult()
    root = shared / NAME / "compute"
    files = sorted(root.glob("*/*/*/mlp.csv.gz"))
    if not files:
        raise FileNotFoundError(f"no vidur mlp.csv.gz files under {root}")
    for path in files:
        gpu_folder, org, model = path.relative_to(root).parts[:3]
        result.add("kernels", NAME, _frame(path, gpu_folder, f"{org}/{model}", gpu))
        progress()
    return result


def n_steps(shared: Path) -> int:
    return len(list((shared / NAME / "compute").glob("*/*/*/mlp.csv.gz")))
