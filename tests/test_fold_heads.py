"""Leak-free GNN folds: a GPU fold's per-op heads never saw that GPU's kernel rows."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from boom_ml.timing import heads as heads_mod
from tests.test_train_ops import canonical_dir
from training import fold_heads, train_gnn
from training.fold_heads import NONE, FoldHeads

SETTINGS = {"n_estimators": 5, "learning_rate": 0.1, "max_train_rows": None, "min_rows": 50,
            "params": {}, "gpu_features": None, "n_jobs": 1, "seed": 0}  # fmt: skip


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> pd.DataFrame:
    from training.kernel_rows import load_training_data

    data = canonical_dir(tmp_path_factory.mktemp("canonical"))
    k = load_training_data({"dir": str(data), "sources": ["neusight_train", "neusight_test"],
                            "exclude_gpus": {"p4": "throttled"}, "max_rows_per_head": 300},
                           log=lambda _m: None)  # fmt: skip
    return k[k["family"].isin(["gemm", "elementwise"])].reset_index(drop=True)


def test_fold_heads_exclude_the_held_out_gpu_and_are_cached(kernels, tmp_path, monkeypatch):
    assert "t4" in set(kernels["gpu_id"])
    folds = FoldHeads(kernels, SETTINGS, tmp_path, log=lambda _m: None)
    model = folds.without("t4")
    others = kernels[kernels["gpu_id"] != "t4"]
    assert model.meta["held_out_gpu"] == "t4"
    assert model.meta["train_rows"] == len(others)
    assert model.meta["train_gpus"] == sorted(others["gpu_id"].unique())
    assert "t4" not in model.meta["train_gpus"]
    for head in model.heads.values():
        assert "t4" not in head.gpus
        assert head.n_rows == int((others["family"] == head.name).sum())
    # A GPU without kernel rows holds nothing out: the fold shares the all-GPU heads.
    assert folds.key("rtx-3090") == NONE and folds.key(None) == NONE
    # The second ask loads the cached model instead of training.
    monkeypatch.setattr(fold_heads, "fit_model", lambda *a, **k: pytest.fail("retrained"))
    again = FoldHeads(kernels, {**SETTINGS, "n_jobs": 2}, tmp_path).without("t4")
    assert again.meta == model.meta
    assert (tmp_path / folds.data_version / "t4" / "model.json").is_file()


def test_fold_heads_hold_out_several_gpus(kernels, tmp_path):
    """A generation fold (``train_ops steps.fold=newer``): no kernel row of any held-out GPU
    reaches the heads; GPUs without kernel rows drop out of the key."""
    held = ["t4", "v100-pcie-32gb", "rtx-3090"]
    assert {"t4", "v100-pcie-32gb"} <= set(kernels["gpu_id"])
    folds = FoldHeads(kernels, SETTINGS, tmp_path, log=lambda _m: None)
    assert folds.key(held) == "t4+v100-pcie-32gb"
    model = folds.without(held)
    others = kernels[~kernels["gpu_id"].isin(held)]
    assert model.meta["held_out_gpus"] == ["t4", "v100-pcie-32gb"]
    assert model.meta["train_rows"] == len(others)
    assert model.meta["train_gpus"] == sorted(others["gpu_id"].unique())
    for head in model.heads.values():
        assert not set(head.gpus) & set(held)
    assert (tmp_path / folds.data_version / "t4+v100-pcie-32gb" / "model.json").is_file()


def test_newer_fold_holds_out_every_gpu_of_the_same_or_a_later_compute_capability():
    from boom_ml.gpus import get_gpu
    from training.train_ops import held_out_for

    ids = ["p100-pcie-16gb", "v100-pcie-32gb", "t4", "a100-80gb-pcie", "a40", "l4", "h100-sxm"]
    specs = {g: get_gpu(g) for g in ids}
    assert held_out_for("a100-80gb-pcie", "gpu", specs) == ["a100-80gb-pcie"]
    assert held_out_for("a100-80gb-pcie", "newer", specs) == [
        "a100-80gb-pcie", "a40", "h100-sxm", "l4"]  # fmt: skip
    assert held_out_for("v100-pcie-32gb", "newer", specs) == [
        "a100-80gb-pcie", "a40", "h100-sxm", "l4", "t4", "v100-pcie-32gb"]  # fmt: skip
    assert held_out_for("l4", "newer", specs) == ["h100-sxm", "l4"]
    with pytest.raises(ValueError, match="steps.fold"):
        held_out_for("l4", "arch", specs)


class _FakeDataset:
    """Stands in for StepGraphDataset: records the per-op function a fold asks for."""

    per_op = "per-op"

    def __init__(self) -> None:
        self.rows = pd.DataFrame({"gpu_id": ["t4", "t4", "v100-pcie-32gb", "rtx-3090"]})
        self.asked: list = []

    def with_per_op(self, name: str, fn) -> _FakeDataset:
        self.asked.append(fn.heads)  # the PerOpModel heads_function wraps
        return self


def test_gnn_gpu_fold_uses_only_heads_without_its_gpu(kernels, tmp_path, monkeypatch):
    """No kernel row of the held-out GPU reaches the fold: its heads (for every row's
    features and baseline) were fit without it, and its step rows are the test set."""
    built = FoldHeads(kernels, SETTINGS, tmp_path, log=lambda _m: None)
    monkeypatch.setattr(FoldHeads, "from_train_ops", classmethod(lambda cls, **kw: built))
    cfg = OmegaConf.create({"fold_heads": {"n_jobs": 1, "cache_dir": None},
                            "cv": {"gpus": True, "families": False}})  # fmt: skip
    ds = _FakeDataset()
    data = train_gnn.FoldData(ds, cfg)
    data.dataset("t4")
    (heads,) = ds.asked
    assert isinstance(heads, heads_mod.PerOpModel)
    assert heads.meta["held_out_gpu"] == "t4" and "t4" not in heads.meta["train_gpus"]
    assert all("t4" not in h.gpus for h in heads.heads.values())
    assert data.held_out("t4") == "t4 kernel rows"
    assert data.held_out("rtx-3090") == "none (all kernel GPUs)"
    (_, held, mask), *_ = [f for f in train_gnn.folds(ds, cfg) if f[1] == "t4"]
    assert held == "t4" and np.array_equal(mask, [True, True, False, False])


def test_an_excluded_gpu_without_rows_is_said(tmp_path_factory) -> None:
    """+data.exclude_gpus.<gpu>=why with a misspelt id excluded nothing without a word."""
    from training.kernel_rows import load_training_data

    data = canonical_dir(tmp_path_factory.mktemp("canonical"))
    said: list[str] = []
    load_training_data({"dir": str(data), "sources": ["neusight_test"],
                        "exclude_gpus": {"t44": "a typo"}}, log=said.append)  # fmt: skip
    assert said[-1].startswith("data.exclude_gpus.t44: no kernel rows of 't44', nothing excluded")
