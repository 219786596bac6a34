"""train_ops on a small real subset: CV table, MLflow round trip, packaged-artifact round trip.

The data are real NeuSight measurements (a few hundred rows per head) read through the
canonical loader; the models are tiny so the whole file runs in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from boom_ml.gpus import get_gpu
from boom_ml.timing.heads import PerOpModel, fit_model, load_model

SMALL = {"n_estimators": 30, "quantile_estimators": 10, "n_jobs": 1}


def canonical_dir(tmp_root: Path) -> Path:
    """The canonical data dir, or NeuSight alone imported into ``tmp_root`` when absent."""
    from data_collection.paths import canonical_data_dir, shared_data_dir

    built = canonical_data_dir()
    if any((built / "kernels").glob("*.parquet")):
        return built
    if not (shared_data_dir() / "neusight").is_dir():
        pytest.skip("no canonical data and no shared NeuSight data to build it from")
    from data_collection.import_public import import_all

    import_all(out_dir=tmp_root, only=["neusight"], progress=False)
    return tmp_root


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return canonical_dir(tmp_path_factory.mktemp("canonical"))


@pytest.fixture(scope="session")
def small_kernels(data_dir) -> pd.DataFrame:
    from training.kernel_rows import load_training_data

    return load_training_data({"dir": str(data_dir), "sources": ["neusight_train", "neusight_test"],
                               "exclude_gpus": {"p4": "throttled"}, "max_rows_per_head": 400},
                              log=lambda _m: None)  # fmt: skip


@pytest.fixture(scope="session")
def small_model(small_kernels) -> PerOpModel:
    specs = {g: get_gpu(g) for g in small_kernels["gpu_id"].unique()}
    return fit_model(small_kernels, specs, log=lambda _m: None, **SMALL)


@pytest.fixture(scope="session")
def small_model_dir(small_model, tmp_path_factory) -> Path:
    return small_model.save(tmp_path_factory.mktemp("per_op"))


def _probe(kernels: pd.DataFrame) -> pd.DataFrame:
    return kernels.groupby("family").head(5).reset_index(drop=True)


def test_fit_model_trains_heads_and_calibrates_fallbacks(small_model):
    assert {"gemm", "conv", "norm", "softmax", "elementwise"} <= set(small_model.heads)
    assert "attention" not in small_model.heads
    assert small_model.fallback["attention"]["proxy"] == "gemm"
    head = small_model.heads["gemm"]
    assert set(head.models) == {"p50", "p10", "p90"} and "p4" not in head.gpus


def test_packaged_artifact_round_trip(small_model, small_model_dir, small_kernels):
    probe = _probe(small_kernels)
    specs = {g: get_gpu(g) for g in probe["gpu_id"].unique()}
    before = small_model.predict_rows(probe, specs)
    after = PerOpModel.load(small_model_dir).predict_rows(probe, specs)
    pd.testing.assert_frame_equal(before, after)
    assert load_model(str(small_model_dir)).heads.keys() == small_model.heads.keys()


def test_train_ops_run_logs_cv_registers_and_round_trips_mlflow(data_dir, tmp_path, small_kernels):
    from omegaconf import OmegaConf

    from training import registry
    from training.train_ops import CONFIG_DIR, run

    cfg = OmegaConf.load(Path(CONFIG_DIR) / "train_ops.yaml")
    cfg.pop("defaults"), cfg.pop("hydra")
    cfg = OmegaConf.merge(cfg, {
        "data": {"dir": str(data_dir), "sources": ["neusight_train", "neusight_test"],
                 "max_rows_per_head": 300},
        "model": {"heads": ["gemm", "softmax"], **SMALL},
        "cv": {"gpus": ["l4", "t4"], "n_estimators": 20, "quantile_estimators": 5},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "registered_model": "test-per-op"},
        "package": True, "package_dir": str(tmp_path / "pkg"),
    })  # fmt: skip
    result = run(cfg, log=lambda _m: None)
    cv = result["cv"]
    assert set(cv["gpu"]) == {"l4", "t4"} and set(cv["head"]) == {"gemm", "softmax"}
    assert np.isfinite(cv["mape"]).all() and (cv["mape"] > 0).all()
    # The registered model loads back (through MLflow) and predicts exactly as trained.
    registry.setup(f"sqlite:///{tmp_path / 'mlflow.db'}", "boom-per-op")
    assert registry.latest_version_uri("test-per-op") == "models:/test-per-op/1"
    loaded = registry.load_logged("models:/test-per-op/1")
    probe = _probe(small_kernels[small_kernels["family"].isin(["gemm", "softmax"])])
    specs = {g: get_gpu(g) for g in probe["gpu_id"].unique()}
    pd.testing.assert_frame_equal(
        result["model"].predict_rows(probe, specs), loaded.predict_rows(probe, specs)
    )
    assert (tmp_path / "mlruns").is_dir()  # artifacts beside the sqlite store
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    assert manifest["version"] == 1 and manifest["heads"] == ["gemm", "softmax"]
    assert "neusight_train" in manifest["data_sources"] and manifest["cv_tables"]
    assert "p4" in manifest["excluded_gpus"]


def test_rows_per_head_dtype_counts_per_head_dtype_and_gpu() -> None:
    from training.train_ops import rows_per_head_dtype

    # SYNTHETIC kernel rows: families map to heads as features.FAMILY_HEAD does (pooling is
    # timed by the elementwise head)
    kernels = pd.DataFrame({
        "family": ["gemm", "gemm", "gemm", "conv", "pooling"],
        "dtype": ["float16", "float16", "float32", "float16", "float32"],
        "gpu_id": ["a40", "a40", "l4", "t4", "t4"],
    })  # fmt: skip
    assert rows_per_head_dtype(kernels) == {
        "gemm": {"float16": {"a40": 2}, "float32": {"l4": 1}},
        "conv": {"float16": {"t4": 1}},
        "elementwise": {"float32": {"t4": 1}},
    }
