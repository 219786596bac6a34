"""Wall time of training every per-op head (median + p10/p90) on the full canonical data.

Run: nice -n 10 python benchmarks/bench_train_ops.py   (target: < 600 s on this machine;
no CV, no MLflow: those are separate costs of ``python -m training.train_ops``)
"""

from __future__ import annotations

import time

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from boom_ml.gpus import get_gpu
from boom_ml.timing.heads import fit_model
from training.kernel_rows import CONFIG_DIR, load_training_data
from training.train_ops import _train_kw

TARGET_S = 600.0


def main() -> None:
    cfg = OmegaConf.to_container(OmegaConf.load(f"{CONFIG_DIR}/train_ops.yaml"), resolve=True)
    t0 = time.perf_counter()
    kernels = load_training_data(cfg["data"], log=lambda _m: None)
    specs = {g: get_gpu(g) for g in kernels["gpu_id"].unique()}
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    model = fit_model(kernels, specs, min_rows=cfg["model"]["min_rows"], log=lambda _m: None,
                      **_train_kw(cfg["model"]))  # fmt: skip
    train_s = time.perf_counter() - t1
    table = Table(title=f"per-op heads on {len(kernels)} canonical kernel rows (this machine)")
    for col in ("head", "rows", "GPUs", "seconds"):
        table.add_column(col)
    for name, head in model.heads.items():
        secs = model.meta["train_seconds"][name]
        table.add_row(name, str(head.n_rows), str(len(head.gpus)), f"{secs:.1f}")
    for name in sorted(set(model.fallback) - set(model.heads)):
        table.add_row(name, "0", "-", "fallback")
    console = Console()
    console.print(table)
    total = load_s + train_s
    verdict = "OK" if total < TARGET_S else "OVER TARGET"
    console.print(f"load {load_s:.1f} s + train {train_s:.1f} s = {total:.1f} s "
                  f"(target < {TARGET_S:.0f} s): {verdict}")  # fmt: skip


if __name__ == "__main__":
    from boom_ml.config_help import doc_help_or_no_args

    if not doc_help_or_no_args(__doc__):  # --help ran the whole benchmark
        main()
