"""How long one parallel prediction takes: Llama-3.1-70B on 64 H100 SXM (issue #14's benchmark).

    python benchmarks/bench_parallel.py

tp8 pp2 dp4, ZeRO-1, bf16 autocast, full checkpointing, micro-batch 1 x 4096 tokens,
8 micro-batches (global batch 32). Target: <= 60 s on this project's 2-core machines; the time
is printed, not asserted. ``--cold`` empties the parallel cache first (traces again).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time
import warnings

MODEL = "hf:meta-llama/Llama-3.1-70B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="clear the parallel cache first")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    started = time.perf_counter()
    from boom_ml.gpus import get_gpu
    from boom_ml.parallel import Cluster, Layout, predict_parallel
    from boom_ml.parallel.shard import cache_dir
    from boom_ml.specs import StepSpec

    if args.cold:
        shutil.rmtree(cache_dir(), ignore_errors=True)
    imported = time.perf_counter()
    layout = Layout(dp=4, tp=8, pp=2, sharding="zero1", microbatches=8)
    step = StepSpec(batch_size=1, seq_len=4096, amp="bf16", checkpointing="full")
    (out,) = predict_parallel(MODEL, [get_gpu("h100-sxm")], step, layout, Cluster(gpus_per_node=8))
    done = time.perf_counter()
    mem, t = out["memory"], out["time"]
    print(f"{MODEL} on {layout.world} x h100-sxm, tp8 pp2 dp4 zero1, bf16, checkpointing full")
    print(
        f"  worst rank: {mem['total_bytes'] / 2**30:.1f} GiB of {mem['capacity_bytes'] / 2**30:.1f} "
        f"(stage {mem['worst_stage']}, fit={mem['fit']})"
    )
    print(
        f"  step {t['step_ms']:.0f} ms: compute {t['compute_ms']:.0f}, exposed comm "
        f"{t['exposed_comm_ms']:.0f} (of {t['comm_ms']:.0f}), bubble {t['bubble_ms']:.0f}; "
        f"{t['samples_per_s']:.2f} samples/s"
    )
    for c in t["collectives"][:4]:
        print(
            f"    {c['op']:<14} {c['group']:<9} {c['bytes'] / 2**20:9.1f} MiB x {c['calls']:<4} "
            f"{c['ms']:8.1f} ms ({c['exposed_ms']:.1f} exposed)  {c['what']}"
        )
    print(f"predicted in {done - imported:.1f} s (imports {imported - started:.1f} s)")


if __name__ == "__main__":
    main()
