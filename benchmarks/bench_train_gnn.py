"""Wall time of training the GNN step-time model on all step data (CV folds + final fit).

Run: python benchmarks/bench_train_gnn.py [hydra overrides]
Traced graphs come from the on-disk cache (the first run traces them; its time is printed
apart). Nothing is packaged or logged: the model goes to a temporary folder.
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch
from hydra import compose, initialize_config_dir

from training.train_gnn import CONFIG_DIR, run


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            cfg = compose(
                "train_gnn", overrides=["mlflow.enabled=false", f"artifact_dir={tmp}", *overrides]
            )
        started = time.perf_counter()
        manifest = run(cfg)
        total = time.perf_counter() - started
    folds = sum(1 for line in manifest["cv"] if "pooled" not in line["held out"])
    print(f"\nbench_train_gnn: {manifest['data']['rows']} rows, {manifest['data']['graphs']} graphs, "
          f"{folds} CV folds + final fit, {cfg.train.epochs} epochs each, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"  training (CV + final): {manifest['train_seconds']:.0f} s")
    print(f"  whole command incl. dataset from cache: {total:.0f} s")


if __name__ == "__main__":
    from boom_ml.config_help import help_requested

    if help_requested(sys.argv[1:]):  # Hydra read --help as an override: a traceback
        print(__doc__.strip())
    else:
        main(sys.argv[1:])
