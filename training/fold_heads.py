"""Per-op heads for one cross-validation fold: trained without the held-out GPU's kernel rows.

A whole-step CV fold that holds out a GPU must not use per-op heads that saw that GPU's
kernels (from any source: NeuSight train and test, Vidur, DeepBench), or its features and
its sum-of-per-op baseline leak the held-out GPU. The heads are the leave-one-GPU-out models
of ``training/cv.py``'s step check (``train_ops steps.*``: 300 trees, learning rate 0.1, no
quantile heads: a fold uses the median only), cached on disk keyed by the held-out GPU and
a hash of the kernel rows and settings, so a re-run does not retrain them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pandas as pd

from boom_ml.gpus import get_gpu
from boom_ml.timing.features import FEATURE_VERSION
from boom_ml.timing.heads import PerOpModel, fit_model
from data_collection.paths import repo_root

DEFAULT_CACHE = repo_root() / "data" / "fold_heads"
NONE = "_none"  # cache folder of the heads trained on every kernel GPU


class FoldHeads:
    """Heads trained without one GPU's kernel rows, built on demand and cached on disk."""

    def __init__(
        self,
        kernels: pd.DataFrame,
        settings: dict[str, Any],
        cache_dir: Path | None = None,
        log: Callable[[str], Any] = print,
    ) -> None:
        self.kernels = kernels
        self.settings = settings
        self.cache_dir = Path(cache_dir) if cache_dir else DEFAULT_CACHE
        self.log = log
        self.gpus = set(kernels["gpu_id"].astype(str))
        self._version: str | None = None

    @classmethod
    def from_train_ops(
        cls,
        n_jobs: int | None = None,
        cache_dir: Path | None = None,
        data_dir: str | None = None,
        log: Callable[[str], Any] = print,
    ) -> FoldHeads:
        """The kernel rows and step-check settings of ``configs/train_ops.yaml``."""
        from training.kernel_rows import load_training_data, train_ops_config

        o = train_ops_config()
        data = {**o["data"], "dir": data_dir or o["data"].get("dir")}
        kernels = load_training_data(data, log)
        return cls(kernels, fold_settings(o, n_jobs), cache_dir, log)

    @property
    def data_version(self) -> str:
        """Hash of the kernel rows, the settings and the feature version (the cache key)."""
        if self._version is None:
            h = hashlib.sha256()
            h.update(pd.util.hash_pandas_object(self.kernels, index=False).to_numpy().tobytes())
            # n_jobs changes speed, not the model: keep it out of the key.
            kept = {k: v for k, v in self.settings.items() if k != "n_jobs"}
            h.update(json.dumps([kept, FEATURE_VERSION], sort_keys=True, default=str).encode())
            self._version = h.hexdigest()[:16]
        return self._version

    def held(self, gpu: str | Collection[str] | None) -> list[str]:
        """The GPUs of ``gpu`` (one id or several) that have kernel rows, sorted."""
        wanted = {gpu} if isinstance(gpu, str) else set(gpu or ())
        return sorted(wanted & self.gpus)

    def key(self, gpu: str | Collection[str] | None) -> str:
        """What a fold's heads hold out: the GPUs among ``gpu`` with kernel rows, else nothing
        (one GPU's key is its id, several join with '+')."""
        return "+".join(self.held(gpu)) or NONE

    def folder(self, gpu: str | Collection[str] | None) -> Path:
        """Where the fold without ``gpu`` is cached (its GEMM model in ``gemm/`` below)."""
        return self.cache_dir / self.data_version / self.key(gpu)

    def without(self, gpu: str | Collection[str] | None) -> PerOpModel:
        """Heads trained on every kernel row except those of ``gpu`` (one GPU id or several;
        all rows when none of them has kernel rows)."""
        key, held, folder = self.key(gpu), self.held(gpu), self.folder(gpu)
        if (folder / "model.json").exists():
            return _with_gemm(PerOpModel.load(folder), self.kernels, held, folder)
        train = self.kernels[~self.kernels["gpu_id"].astype(str).isin(held)]
        cap = self.settings.get("max_train_rows")
        if cap and len(train) > cap:
            train = train.sample(int(cap), random_state=int(self.settings.get("seed", 0)))
        specs = {g: get_gpu(g) for g in sorted(train["gpu_id"].astype(str).unique())}
        started = time.perf_counter()
        s = self.settings
        model = fit_model(
            train, specs, min_rows=s["min_rows"], log=lambda _m: None,
            params={**(s.get("params") or {}), "learning_rate": s["learning_rate"]},
            n_estimators=s["n_estimators"], quantile_estimators=0,
            gpu_features=s.get("gpu_features"), n_jobs=int(s.get("n_jobs", 1)),
            seed=int(s.get("seed", 0)),
        )  # fmt: skip
        model.meta.update({
            "held_out_gpu": None if key == NONE else key,
            "held_out_gpus": held,
            "train_gpus": sorted(specs),
            "train_rows": len(train),
            "data_version": self.data_version,
        })  # fmt: skip
        model.save(folder)
        self.log(f"fold heads without {key}: {len(train)} kernel rows, "
                 f"{time.perf_counter() - started:.0f} s (cached in {folder})")  # fmt: skip
        return _with_gemm(model, self.kernels, held, folder)


def _with_gemm(
    model: PerOpModel, kernels: pd.DataFrame, held: list[str], folder: Path
) -> PerOpModel:
    """The fold's tile/wave GEMM model (training/train_gemm.py), fit without the same GPU and
    cached beside the heads, attached as ``model.gemm`` for per_op's GEMM hook; not fit while
    step times leave GEMMs to the heads (``boom_ml.timing.gemm.STEP_TIMES``): nothing reads it."""
    from boom_ml.timing import gemm as gemm_tiles
    from training.train_gemm import fold_gemm

    if not gemm_tiles.STEP_TIMES:
        return model
    model.gemm = fold_gemm(kernels, held, folder / "gemm")  # type: ignore[attr-defined]
    return model


def fold_settings(o: dict[str, Any], n_jobs: int | None = None) -> dict[str, Any]:
    """LightGBM settings of a fold's heads: ``train_ops``' step-check ones (``steps.*``)."""
    s, m = o["steps"], o["model"]
    return {
        "n_estimators": int(s["n_estimators"]),
        "learning_rate": float(s["learning_rate"]),
        # The step check samples 3x its per-head cap from all rows (376k today: all of them).
        "max_train_rows": int(s["max_train_rows"]) * 3 if s.get("max_train_rows") else None,
        "min_rows": int(m["min_rows"]),
        "params": dict(m.get("params") or {}),
        "gpu_features": m.get("gpu_features"),
        "n_jobs": int(n_jobs if n_jobs is not None else m.get("n_jobs", 1)),
        "seed": int(o.get("seed", 0)),
    }
