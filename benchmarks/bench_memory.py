"""Wall time of a whole prediction (trace, memory model with max batch search, timing,
advice) and of the memory model alone, for the two reference cases of the memory issue.

Run: nice python benchmarks/bench_memory.py   (timings are for this machine; targets:
Llama-3-8B bs1x2048 bf16 + checkpointing + AdamW < 60 s, resnet50 bs128 < 10 s)
"""

from __future__ import annotations

import time
from functools import partial

from rich.console import Console
from rich.table import Table

from boom_ml.api import predict
from boom_ml.gpus import get_gpu
from boom_ml.max_batch import max_batch_size
from boom_ml.memory.estimate import estimate_memory
from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace.graph import OpGraph
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model

GPU = "a100-80gb-sxm"
CASES = [
    (
        "hf:meta-llama/Meta-Llama-3-8B",
        dict(batch_size=1, seq_len=2048, optimizer="adamw", amp="bf16", checkpointing="full"),
        60.0,
    ),
    ("torchvision:resnet50", dict(batch_size=128, optimizer="adamw"), 10.0),
]
GiB = float(1 << 30)


def _trace_at(model: str, step: dict, batch: int) -> OpGraph:
    return trace_step(build_model(ModelSpec(model)), StepSpec(**{**step, "batch_size": batch}))


def main() -> None:
    table = Table(title=f"memory prediction on {GPU} (this machine)")
    for col in ("model", "step", "predict s", "target s", "trace s", "memory s",
                "max batch s", "total GiB", "fits", "max batch"):  # fmt: skip
        table.add_column(col)
    for model, step, target in CASES:
        t0 = time.perf_counter()
        result = predict(model, gpu=GPU, **step)
        t_predict = time.perf_counter() - t0
        # The memory model alone, on a fresh trace (no cached search).
        graph = trace_step(build_model(ModelSpec(model)), StepSpec(**step))
        t1 = time.perf_counter()
        est = estimate_memory(graph, get_gpu(GPU))
        t2 = time.perf_counter()
        retrace = partial(_trace_at, model, step)
        largest = max_batch_size(graph, get_gpu(GPU), retrace).batch_size
        t3 = time.perf_counter()
        shape = " ".join(f"{k}={v}" for k, v in step.items())
        table.add_row(
            model, shape, f"{t_predict:.1f}", f"{target:.0f}",
            f"{result.graph['trace_seconds']:.1f}", f"{t2 - t1:.1f}", f"{t3 - t2:.1f}",
            f"{est.total_bytes / GiB:.1f}", est.fit, str(largest),
        )  # fmt: skip
    Console(width=170).print(table)


if __name__ == "__main__":
    from boom_ml.config_help import doc_help_or_no_args

    if not doc_help_or_no_args(__doc__):  # --help ran the whole benchmark
        main()
