"""Wall time of the two harness dry runs (device=cpu dry_run=true), the CI-sized end-to-end
paths of data_collection: each must stay under a minute on a 2-core machine.

Run: python benchmarks/bench_dry_runs.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    table = Table(title=f"harness dry runs ({os.cpu_count()} CPUs; one cold process each)")
    for col in ("command", "wall s", "rc", "summary"):
        table.add_column(col)
    with tempfile.TemporaryDirectory(prefix="boom-dry-") as tmp:
        env = {**os.environ, "BOOM_HYDRA_DIR": tmp, "TRANSFORMERS_VERBOSITY": "error"}
        for harness in ("kernels", "steps"):
            cmd = [sys.executable, "-m", f"data_collection.{harness}", "device=cpu",
                   "dry_run=true", f"out={tmp}/{harness}"]  # fmt: skip
            start = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - start
            summary = next(
                (line for line in proc.stdout.splitlines() if line.startswith(f"{harness}:")),
                proc.stderr.strip().splitlines()[-1][:100] if proc.stderr.strip() else "",
            )
            table.add_row(" ".join(cmd[1:4]) + " dry_run=true", f"{wall:.1f}",
                          str(proc.returncode), summary.split(" -> ")[0])  # fmt: skip
    Console(width=160).print(table)


if __name__ == "__main__":
    from boom_ml.config_help import doc_help_or_no_args

    if not doc_help_or_no_args(__doc__):  # --help ran the whole benchmark
        main()
