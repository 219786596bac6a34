"""Validate the parallel step-time model on vTrain's 1,549 measured Megatron GPT runs (A100).

    nice python -m training.validate_parallel              # every row
    nice python -m training.validate_parallel --limit 50   # a quick look
    nice python -m training.validate_parallel --precision amp   # as traced before (AMP)

Data: ``shared/data/vtrain/`` (SOURCE.md). Megatron-DeepSpeed GPT, fp16 mixed precision,
activation checkpointing, 1F1B, Adam, A100 (variant not recorded; an 8-GPU NVLink node implies
SXM, so a100-80gb-sxm: NVLink 3 inside a node, InfiniBand HDR200 per GPU across nodes, the DGX
A100 layout), 8 GPUs per node, no gradient buckets (``use_gradient_bucket: false``: the
data-parallel all-reduce runs after the backward, not overlapped).

The model of each row: a Megatron GPT layer as an HF ``nemotron`` config (LayerNorm, non-gated
GELU MLP of 4 x hidden, biases, head_dim = hidden / heads; the closest HF architecture whose
heads can be divided without the hidden size), vocabulary 50,257 padded to a multiple of
128 x tp (Megatron's ``make-vocab-size-divisible-by``), tied embeddings, no dropout inside
attention (so the flash kernel runs). Precision is Megatron's ``--fp16``: the model's
parameters, activations and gradients in fp16, an fp32 master copy of every parameter stepped
by the optimizer, a dynamic loss scale (``Float16OptimizerWithFloat16Params``:
``params_dtype=fp16 master_weights=true``); ``--precision amp`` traces PyTorch autocast over
fp32 parameters instead, as this validation did before ``master_weights`` existed (per-op
casts Megatron does not run). Gradients are all-reduced in fp16 (2 bytes, Megatron's fp16
default without ``accumulate-allreduce-grads-in-fp32``; an assumption, not recorded), and
Adam is one fused kernel (``optimizer_impl=fused``; Megatron uses apex's FusedAdam).

Held out means held out. Two results are printed: ``raw`` (nothing fitted on vTrain) and
``calibrated``: three constants, a multiplier on every per-rank compute time, a further one on
the memory-bound kernels (Megatron fuses or skips many of the elementwise and copy kernels an
HF model under autocast runs) and the host time per dispatched op (the floor under host-bound
stages; Megatron's Python per op costs more than plain eager PyTorch's), fitted together by
minimising MAPE on the 2-GPU rows only (the split is fixed up front); every 4-, 8- and
multi-node row is then held out. vTrain's own published errors: 8.37 % single node, 14.73 % multi-node.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import re
import statistics
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "vtrain"
GPU = "a100-80gb-sxm"
VOCAB = 50257
FIT_GPUS = 2  # the calibration split: rows with this many GPUs
VTRAIN_PUBLISHED = {"single node": 8.37, "multi-node": 14.73}
TARGETS = {"single node": 10.0, "multi-node": 15.0}


def load_rows(data: Path = DATA) -> list[dict[str, Any]]:
    rows = []
    for name, multi in (("ground_truth_single.csv", False), ("ground_truth_multi.csv", True)):
        with open(data / name, newline="") as fh:
            for r in csv.DictReader(fh):
                rows.append({
                    "gpus": int(r["# GPUs"]), "global": int(r["global batch"]),
                    "micro": int(r["micro batch"]), "hidden": int(r["hidden size"]),
                    "heads": int(r["attention heads"]), "layers": int(r["# layers"]),
                    "seq": int(r["sequence length"]), "tp": int(r["tensor parallelism"]),
                    "dp": int(r["data parallelism"]), "pp": int(r["pipeline parallelism"]),
                    "measured_ms": float(r["iteration time (ms)"]), "multi": multi,
                })  # fmt: skip
    return rows


def megatron_gpt(row: dict[str, Any]) -> dict[str, Any]:
    """A Megatron GPT of the row's shape as an HF nemotron config (see the module doc)."""
    h, heads, tp = row["hidden"], row["heads"], row["tp"]
    multiple = 128 * tp
    return {
        "model_type": "nemotron",
        "architectures": ["NemotronForCausalLM"],
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": h // heads,
        "intermediate_size": 4 * h,
        "num_hidden_layers": row["layers"],
        "vocab_size": math.ceil(VOCAB / multiple) * multiple,
        "max_position_embeddings": row["seq"],
        "hidden_act": "gelu",
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
        "attention_dropout": 0.0,
        "norm_eps": 1e-5,
        "bos_token_id": None,
        "eos_token_id": None,
    }


PRECISIONS = {
    "master": {"params_dtype": "fp16", "master_weights": True},  # Megatron --fp16
    "amp": {"amp": "fp16"},  # PyTorch autocast over fp32 parameters
}


def predict_row(
    row: dict[str, Any],
    gpu: Any,
    compute_scale: float = 1.0,
    dispatch_us: float | None = None,
    other_scale: float = 1.0,
    precision: str = "master",
) -> dict[str, Any]:
    from boom_ml.parallel.layout import Cluster, Layout
    from boom_ml.parallel.predict import predict_raw
    from boom_ml.specs import StepSpec

    micro = row["global"] // (row["micro"] * row["dp"])
    # Megatron accumulates in its weight-gradient GEMMs (gradient accumulation fusion); one
    # micro-batch accumulates nothing, and a layout refuses the key it would not read
    layout = Layout(dp=row["dp"], tp=row["tp"], pp=row["pp"], microbatches=micro,
                    grad_accumulation="fused" if micro > 1 else "add")  # fmt: skip
    # Megatron steps Adam with apex's FusedAdam: one fused kernel, as torch's fused Adam
    step = StepSpec(batch_size=row["micro"], seq_len=row["seq"], optimizer="adam",
                    optimizer_impl="fused", checkpointing="full",
                    **PRECISIONS[precision])  # fmt: skip
    out = predict_raw(megatron_gpt(row), [gpu], step, layout, Cluster(gpus_per_node=8),
                      memory=False, compute_scale=compute_scale, other_scale=other_scale,
                      grad_bytes=2, full_recompute=True,  # Megatron recomputes whole layers
                      **({} if dispatch_us is None else {"dispatch_us": dispatch_us}),
                      overlap_grad_reduce=False)  # fmt: skip
    return out[0]["time"]


def mape(pairs: list[tuple[float, float]]) -> float:
    return 100 * sum(abs(p - m) / m for p, m in pairs) / len(pairs) if pairs else float("nan")


def fit_constants(
    rows: list[dict[str, Any]], gpu: Any, precision: str = "master"
) -> dict[str, float]:
    """Compute multiplier, memory-bound multiplier and host us per op minimising MAPE on
    ``rows``: coordinate descent over one grid per constant, three rounds."""

    def score(c: dict[str, float]) -> float:
        pairs = [(predict_row(r, gpu, **c, precision=precision)["step_ms"], r["measured_ms"])
                 for r in rows]  # fmt: skip
        return mape(pairs)

    grids = {
        "compute_scale": [k / 20 for k in range(10, 31)],  # 0.5 .. 1.5
        "other_scale": [k / 20 for k in range(2, 61)],  # 0.1 .. 3.0
        "dispatch_us": [2.5 * k for k in range(1, 17)],  # 2.5 .. 40
    }
    best = {"compute_scale": 1.0, "other_scale": 1.0, "dispatch_us": 5.0}
    for _ in range(3):
        for name, grid in grids.items():
            best[name] = min(grid, key=lambda v, n=name: score({**best, n: v}))
    return best


def table(rows: list[dict[str, Any]], key: str, fit_label: str) -> list[str]:
    lines = [
        f"| {key} | rows | raw MAPE % | calibrated MAPE % | median predicted / measured (raw) | split |",
        "|---|---|---|---|---|---|",
    ]
    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r[key]].append(r)
    for k in sorted(groups, key=lambda k: [int(x) for x in re.findall(r"\d+", str(k))]):
        g = groups[k]
        raw = mape([(r["raw_ms"], r["measured_ms"]) for r in g])
        cal = mape([(r["cal_ms"], r["measured_ms"]) for r in g])
        split = (
            "fit"
            if all(r["gpus"] == FIT_GPUS for r in g)
            else ("held out" if all(r["gpus"] != FIT_GPUS for r in g) else fit_label)
        )
        ratio = statistics.median(r["raw_ms"] / r["measured_ms"] for r in g)
        lines.append(f"| {k} | {len(g)} | {raw:.1f} | {cal:.1f} | {ratio:.2f} | {split} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=0,
                        help="about N rows, evenly spaced over the data (0: all)")  # fmt: skip
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="master",
                        help="master: Megatron's fp16 with fp32 master weights (default); "
                             "amp: PyTorch autocast over fp32 parameters")  # fmt: skip
    args = parser.parse_args(argv)
    if args.limit < 0:
        parser.error(f"--limit {args.limit}: a number of rows, 0 for all")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    started = time.perf_counter()
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel.time import DISPATCH_US

    gpu = get_gpu(GPU)
    rows = load_rows()
    if args.limit:
        step = max(len(rows) // args.limit, 1)
        rows = rows[::step]
    for i, r in enumerate(rows):
        r["raw_ms"] = predict_row(r, gpu, precision=args.precision)["step_ms"]
        if i % 100 == 0:
            print(f"  {i}/{len(rows)} rows, {time.perf_counter() - started:.0f} s", flush=True)
    fit_rows = [r for r in rows if r["gpus"] == FIT_GPUS]
    fitted = fit_constants(fit_rows, gpu, args.precision) if fit_rows else {}
    for r in rows:
        r["cal_ms"] = predict_row(r, gpu, **fitted, precision=args.precision)["step_ms"]
        r["nodes"] = "multi-node" if r["multi"] else "single node"
        r["tp_pp"] = f"tp{r['tp']} pp{r['pp']}"
    consts = ", ".join(f"{k}={v:g}" for k, v in fitted.items())
    print(f"\nvTrain, {len(rows)} rows, {GPU}, precision={args.precision}; raw: nothing fitted (host floor {DISPATCH_US:g} us"
          f"/op); calibrated: {consts}, fitted on the {len(fit_rows)} {FIT_GPUS}-GPU rows only"
          f" (the rest held out)\n")  # fmt: skip
    print("\n".join(table(rows, "gpus", "mixed")))
    print()
    print("\n".join(table(rows, "tp_pp", "mixed")))
    print()
    print(
        "| split | rows | raw MAPE % | calibrated MAPE % (held out only) | vTrain published | target |"
    )
    print("|---|---|---|---|---|---|")
    for name in ("single node", "multi-node"):
        g = [r for r in rows if r["nodes"] == name]
        held = [r for r in g if r["gpus"] != FIT_GPUS]
        raw = mape([(r["raw_ms"], r["measured_ms"]) for r in g])
        cal = mape([(r["cal_ms"], r["measured_ms"]) for r in held])
        print(f"| {name} | {len(g)} ({len(held)} held out) | {raw:.1f} | {cal:.1f} | "
              f"{VTRAIN_PUBLISHED[name]} | <= {TARGETS[name]} |")  # fmt: skip
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
