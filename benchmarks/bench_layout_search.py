"""How long the advisor's layout search takes over every packaged GPU (trace cache warm).

    python benchmarks/bench_layout_search.py [--runs 1]

Llama-3-8B, batch 4 x 2048, bf16 autocast, AdamW: the search `gpu=all` advice runs for the
GPUs the step does not fit. Prints, per run, the wall and CPU seconds of
``search_layouts_many`` over the 44 GPUs and how many GPUs got a layout. A run traces the
small per-rank models where the disk cache lacks them (run it once first); runs after the
first in one process reuse its in-memory caches, so compare first runs of fresh processes.
Printed, not asserted.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

MODEL = "hf:meta-llama/Meta-Llama-3-8B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from boom_ml.gpus import all_gpus
    from boom_ml.parallel.search import search_layouts_many
    from boom_ml.specs import StepSpec

    step = StepSpec(batch_size=4, seq_len=2048, amp="bf16", optimizer="adamw")
    gpus = all_gpus()
    print("| run | wall s | CPU s | GPUs with a layout | layouts searched |")
    print("|---|---|---|---|---|")
    for run in range(1, args.runs + 1):
        wall, cpu = time.perf_counter(), time.process_time()
        found = search_layouts_many(MODEL, gpus, step)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        placed = sum(1 for f in found.values() if f["layouts"])
        searched = next(iter(found.values()))["searched"]
        print(f"| {run} | {wall:.2f} | {cpu:.2f} | {placed} of {len(gpus)} | {searched} |")


if __name__ == "__main__":
    main()
