"""Prediction latency as a user meets it: cold processes, the trace cache, a warm Python API.

Run: python benchmarks/bench_predict.py [--quick] [--runs N]
  --quick   only the cheap rows (errors, --help, the default command, the Python API);
            without it the issue's large cases run once each (minutes: Llama-3-8B on all GPUs).

Every row is wall-clock seconds on this machine. Cold-process rows run ``--runs`` times
(median, min-max); the large cases run once, with an empty trace cache. The trace cache is
a fresh temporary directory ($BOOM_CACHE_DIR), so "cold" means nothing traced before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
PREDICT = [sys.executable, "-m", "boom_ml.predict"]
LLAMA = [
    "model=hf:meta-llama/Meta-Llama-3-8B", "gpu=all", "batch_size=4", "seq_len=2048",
    "amp=bf16", "optimizer=adamw",
]  # fmt: skip
BERT = [
    "model=hf:bert-large-uncased", "gpu=h100-sxm", "batch_size=64", "seq_len=384",
    "amp=fp16", "optimizer=adamw",
]  # fmt: skip
# In one process: import, a first call, the same call again, then the same model on every GPU.
API_SCRIPT = """
import json, time
t0 = time.perf_counter()
import boom_ml
import boom_ml.api  # torch, lightgbm, torch_geometric: what a first call would import
from boom_ml.gpus import all_gpus
t1 = time.perf_counter()
kw = dict(model="torchvision:resnet50", batch_size=32)
boom_ml.predict(gpu="h100-sxm", **kw)
t2 = time.perf_counter()
boom_ml.predict(gpu="h100-sxm", **kw)
t3 = time.perf_counter()
boom_ml.predict(gpu="all", **kw)
t4 = time.perf_counter()
boom_ml.predict(gpu="all", max_batch="on", **kw)
t5 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "first": t2 - t1, "again": t3 - t2, "all": t4 - t3,
                  "all_max_batch": t5 - t4, "gpus": len(all_gpus())}))
"""


TIMEOUT_S = 1800  # one process; a row that runs out says so instead of hanging the table


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """(wall seconds, exit status, last stderr line) of one cold process."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, -9, f"killed after {TIMEOUT_S} s"
    wall = time.perf_counter() - start
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return wall, proc.returncode, lines[-1][:90] if lines else ""


def repeat(cmd: list[str], env: dict[str, str], runs: int) -> tuple[str, int, str]:
    walls, rc, last = [], 0, ""
    for _ in range(runs):
        wall, rc, last = timed(cmd, env)
        walls.append(wall)
    spread = f"{statistics.median(walls):.2f} ({min(walls):.2f}-{max(walls):.2f})"
    return spread, rc, last


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the cheap rows")
    parser.add_argument("--runs", type=int, default=5, help="runs of each cold-process row")
    args = parser.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="boom-bench-cache-")
    env = {**os.environ, "BOOM_CACHE_DIR": cache, "TRANSFORMERS_VERBOSITY": "error"}
    table = Table(title=f"boom_ml.predict latency ({os.cpu_count()} CPUs; wall seconds)")
    for col, justify in (
        ("case", "left"),
        ("seconds", "right"),
        ("rc", "right"),
        ("notes", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]

    def row(case: str, cmd: list[str], runs: int = 1, note: str = "") -> None:
        seconds, rc, last = repeat(cmd, env, runs)
        table.add_row(case, seconds, str(rc), note or last)
        print(f"{case}: {seconds} s (rc {rc})", file=sys.stderr, flush=True)

    runs = args.runs
    row("error: predict gpu=h100-sxn", [*PREDICT, "gpu=h100-sxn"], runs)
    row('python -c "import torch"', [sys.executable, "-c", "import torch"], runs)
    row("predict --help", [*PREDICT, "--help"], runs, "help text")
    row("python -m boom_ml.gpus", [sys.executable, "-m", "boom_ml.gpus"], runs, "GPU table")
    row("default command, trace cache empty", PREDICT, 1, "resnet50 bs32, 3 GPUs")
    row("default command again (cache hit)", PREDICT, runs, "same config, new process")
    row("default command, cache=off", [*PREDICT, "cache=off"], 1, "traces afresh")

    proc = subprocess.run([sys.executable, "-c", API_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode == 0:
        api = json.loads(proc.stdout.strip().splitlines()[-1])
        extra = (api["all"] - api["again"]) / (api["gpus"] - 1)
        table.add_row("API: import boom_ml + api", f"{api['import']:.2f}", "0", "one process")
        table.add_row("API: first call, 1 GPU", f"{api['first']:.2f}", "0", "cache hit on disk")
        table.add_row("API: same call again (warm)", f"{api['again']:.2f}", "0", "h100-sxm")
        table.add_row(f"API: gpu=all ({api['gpus']} GPUs, max batch auto: off)", f"{api['all']:.2f}", "0",
                      f"+{api['all'] - api['again']:.2f} s over 1 GPU, {extra:.3f} s per extra GPU")  # fmt: skip
        extra_mb = (api["all_max_batch"] - api["again"]) / (api["gpus"] - 1)
        table.add_row("API: gpu=all max_batch=on", f"{api['all_max_batch']:.2f}", "0",
                      f"+{api['all_max_batch'] - api['again']:.2f} s over 1 GPU, "
                      f"{extra_mb:.3f} s per extra GPU")  # fmt: skip
    else:
        table.add_row("API rows", "-", str(proc.returncode), proc.stderr.strip()[-90:])

    if not args.quick:
        row("Llama-3-8B bs4x2048 bf16 gpu=all (cold)", [*PREDICT, *LLAMA], 1, "trace cache empty")
        row("BERT-large bs64x384 fp16 1 GPU (cold)", [*PREDICT, *BERT], 1, "h100-sxm, cache empty")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
