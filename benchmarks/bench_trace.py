"""Trace time and op count of one training step for three reference models.

Run: python benchmarks/bench_trace.py   (prints a table; timings are for this machine)
"""

from __future__ import annotations

import resource
import time

from rich.console import Console
from rich.table import Table

from boom_ml.specs import ModelSpec, StepSpec
from boom_ml.trace.step import trace_step
from boom_ml.zoo import build_model

CASES = [
    ("torchvision:resnet50", StepSpec(batch_size=64)),
    ("hf:gpt2-large", StepSpec(batch_size=4, seq_len=1024)),
    (
        "hf:meta-llama/Meta-Llama-3-8B",
        StepSpec(batch_size=1, seq_len=2048, amp="bf16", checkpointing="full"),
    ),
]


def main() -> None:
    table = Table(title="trace one training step (fake tensors, CPU)")
    for col in (
        "model",
        "batch",
        "amp",
        "ckpt",
        "ops",
        "TFLOP",
        "build s",
        "trace s",
        "max RSS GiB",
    ):
        table.add_column(col)
    for model, step in CASES:
        t0 = time.perf_counter()
        built = build_model(ModelSpec(model))
        t1 = time.perf_counter()
        graph = trace_step(built, step)
        t2 = time.perf_counter()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
        shape = f"{step.batch_size}" + (f"x{step.seq_len}" if step.seq_len else "")
        table.add_row(
            model, shape, step.amp, step.checkpointing, str(graph.num_ops),
            f"{graph.flops / 1e12:.1f}", f"{t1 - t0:.1f}", f"{t2 - t1:.1f}", f"{rss:.2f}",
        )  # fmt: skip
    Console(width=150).print(table)


if __name__ == "__main__":
    from boom_ml.config_help import doc_help_or_no_args

    if not doc_help_or_no_args(__doc__):  # --help ran the whole benchmark
        main()
