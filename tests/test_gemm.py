"""The tile/wave GEMM model: exact tile and wave counts, the roofline bound, the per-op hook,
and one leave-one-GPU-out fit on real NeuSight rows whose error bound can fail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from boom_ml.gpus import get_gpu
from boom_ml.timing.gemm import (
    METHOD,
    PACKAGED_DIR,
    GemmModel,
    gemm_dims,
    gemm_features,
    override_gemm,
    select_tile,
    tile_waves,
)

A100 = get_gpu("a100-80gb-pcie")  # 108 SMs


def _arr(*v: float) -> np.ndarray:
    return np.array(v, dtype=float)


def test_tiles_and_waves_exact() -> None:
    # 4096 x 4096 output in 128 x 128 tiles: 32 * 32 = 1024 tiles; 108 SMs, 1 tile per SM:
    # 9 full waves (972 tiles) and a tail of 52 tiles in 108 slots.
    tiles, waves, tail = tile_waves(
        _arr(1), _arr(4096), _arr(4096), _arr(128), _arr(128), _arr(108)
    )
    assert (tiles[0], waves[0]) == (1024, 10)
    assert tail[0] == pytest.approx(52 / 108)
    # A batch of 3 ragged outputs: ceil(100/64) * ceil(70/32) = 2 * 3 = 6 tiles each, 18 in
    # all; 2 tiles per SM on 4 SMs gives 8 slots: 3 waves, the last holding 2 of 8.
    tiles, waves, tail = tile_waves(_arr(3), _arr(100), _arr(70), _arr(64), _arr(32), _arr(4), 2)
    assert (tiles[0], waves[0], tail[0]) == (18, 3, 0.25)
    # Exactly full waves leave no partial tail.
    _, waves, tail = tile_waves(
        _arr(1), _arr(128 * 108), _arr(128), _arr(128), _arr(128), _arr(108)
    )
    assert (waves[0], tail[0]) == (1, 1.0)


def test_tile_choice_fills_the_gpu() -> None:
    sms, simt = _arr(108, 108, 108), np.zeros(3, bool)
    tm, tn = select_tile(_arr(1, 1, 1), _arr(4096, 512, 64), _arr(4096, 512, 64), sms, simt)
    # 4096^2: 128x128 gives 1024 tiles >= 108. 512^2: 128x128 -> 16, 128x64 -> 32,
    # 64x64 -> 64, 64x32 -> 128 >= 108. 64^2: nothing fills 108 SMs -> the smallest, 32x32.
    assert list(zip(tm, tn, strict=True)) == [(128, 128), (64, 32), (32, 32)]
    tm, tn = select_tile(_arr(1), _arr(8192), _arr(8192), _arr(108), np.ones(1, bool))
    assert (tm[0], tn[0]) == (256, 128)  # tensor cores: the largest CUTLASS tile


def test_dims_follow_the_canonical_convention() -> None:
    rows = pd.DataFrame({"op": ["linear", "bmm"], "b": [2, 8], "m": [3, 5], "n": [7, 11],
                         "k": [13, 17], "dtype": "float32"})  # fmt: skip
    batch, m, red, out, bias, bmm = gemm_dims(rows)
    assert list(batch) == [1, 8] and list(m) == [6, 5]  # linear folds b into the rows
    assert list(red) == [7, 11] and list(out) == [13, 17]
    assert list(bias) == [True, False] and list(bmm) == [False, True]


def _toy_model(features: pd.DataFrame) -> GemmModel:
    """An MLP whose raw output is a large negative number: softplus ~ 0, i.e. the floor."""
    cols = ["log_m"]
    return GemmModel("mlp", cols, mlp={"mean": [0.0], "std": [1.0],
                                       "layers": [[[[0.0]], [-50.0]]]})  # fmt: skip


def test_never_faster_than_the_roofline() -> None:
    rows = pd.DataFrame({"op": ["linear", "bmm", "linear"], "b": [1, 64, 1],
                         "m": [4096, 128, 7], "n": [4096, 64, 3], "k": [4096, 128, 5],
                         "dtype": ["float32", "float16", "float32"]})  # fmt: skip
    feats = gemm_features(rows, A100)
    assert (feats["roof_ms"] >= feats["bound_ms"] - 1e-12).all()
    ms = _toy_model(feats).predict_ms(feats)
    np.testing.assert_allclose(ms, feats["bound_ms"], rtol=1e-9)  # floor: the plain roofline
    # 4096^3 fp32 on the A100: 2*4096^3 / 19.5e12 s plus the launch cost.
    assert feats["bound_ms"][0] == pytest.approx(2 * 4096**3 / 19.5e12 * 1e3 + 0.005)


def test_override_retimes_only_gemm_rows() -> None:
    rows = pd.DataFrame({"op": ["linear", "relu", "bmm"], "family": ["gemm", "elementwise", "gemm"],
                         "b": [1, None, 4], "m": [256, None, 64], "n": [512, None, 64],
                         "k": [1024, None, 64], "numel": [None, 1000, None],
                         "dtype": "float32"})  # fmt: skip
    pred = pd.DataFrame({"pred_ms": [9.0, 9.0, 9.0], "p10_ms": 8.0, "p90_ms": 10.0,
                         "method": "per-op"})  # fmt: skip
    model = _toy_model(gemm_features(rows.iloc[[0, 2]], A100))
    out = override_gemm(rows, A100, pred, model)
    assert list(out["method"]) == [METHOD, "per-op", METHOD]
    assert out["pred_ms"][1] == 9.0 and out["pred_ms"][0] < 1.0
    assert override_gemm(rows, A100, pred, None) is pred


def test_only_fp32_and_tf32_gemms_go_to_the_tile_model() -> None:
    # fp16/bf16 GEMMs stay with the heads (TILE_DTYPES: the leave-one-GPU-out comparison)
    from boom_ml.predict_ops import predict_canonical

    rows = pd.DataFrame({"op": "linear", "family": "gemm", "direction": "forward", "b": 1,
                         "m": 512, "n": 1024, "k": 1024,
                         "dtype": ["float32", "tf32", "float16", "bfloat16"]})  # fmt: skip
    out = predict_canonical(rows, "a100-40gb-pcie")  # a measured GPU: nothing capped
    assert out["method"].tolist() == [METHOD, METHOD, "per-op", "per-op"]


def test_routing_means_weigh_each_gpu_alike() -> None:
    from training.gemm_routing import per_dtype

    # a synthetic table: GPU a's two fp32 sources weigh by rows (10 x 1 % + 30 x 5 % = 4 %)
    table = pd.DataFrame({"gpu": ["a", "a", "b", "b"], "dtype": ["float32", "float32", "float32", "float16"],
                          "source": ["x", "y", "x", "x"], "rows": [10, 30, 5, 7],
                          "head": [1.0, 5.0, 10.0, 20.0], "tiles": [2.0, 2.0, 4.0, 30.0]})  # fmt: skip
    mean = per_dtype(table)
    assert mean.loc["float32"].tolist() == [2, 7.0, 3.0, "tiles"]  # (4 + 10) / 2, (2 + 4) / 2
    assert mean.loc["float16"].tolist() == [1, 20.0, 30.0, "head"]


def _canonical(tmp_root: Path) -> Path:
    from data_collection.paths import canonical_data_dir, shared_data_dir

    built = canonical_data_dir()
    if any((built / "kernels").glob("neusight_*.parquet")):
        return built
    if not (shared_data_dir() / "neusight").is_dir():
        pytest.skip("no canonical data and no shared NeuSight data to build it from")
    from data_collection.import_public import import_all

    import_all(out_dir=tmp_root, only=["neusight"], progress=False)
    return tmp_root


@pytest.fixture(scope="module")
def canonical(tmp_path_factory) -> Path:
    return _canonical(tmp_path_factory.mktemp("canonical"))


def test_held_out_a100_error_on_real_rows(canonical: Path) -> None:
    """Fit on NeuSight rows of the other GPUs only (the A100-80GB's rows never reach the fit)
    and score its fp32 bmm and linear rows: this small fit scores 6.1 / 8.7 %, the packaged
    variant's full fold 5.7 / 6.1 % (README); a broken tile count or bound lands far above."""
    from training.gemm_learners import fit_variant

    kernels = pd.read_parquet([p for p in (canonical / "kernels").glob("neusight_*.parquet")])
    kernels = kernels[kernels["family"].eq("gemm") & kernels["gpu_id"].ne("p4")].reset_index(
        drop=True
    )
    held = kernels["gpu_id"].eq("a100-80gb-pcie").to_numpy()
    train = np.flatnonzero(~held)
    train = np.random.default_rng(0).choice(train, 20000, replace=False)
    specs = {g: get_gpu(g) for g in kernels["gpu_id"].unique()}
    feats = gemm_features(kernels, specs)
    y = np.log(kernels["latency_ms"].to_numpy() / feats["roof_ms"].to_numpy())
    o = {"lgb": {"n_estimators": 80, "params": {"learning_rate": 0.15, "num_leaves": 31,
                                                "min_child_samples": 100}},
         "threads": 1, "seed": 0}  # fmt: skip
    assert not held[train].any()
    model = fit_variant(feats.iloc[train], y[train], {"learner": "lgb", "gpu_features": "spec"}, o)
    test = np.flatnonzero(held)
    ape = np.abs(model.predict_ms(feats.iloc[test]) / kernels["latency_ms"].to_numpy()[test] - 1)
    op = kernels["op"].to_numpy()[test]
    for name in ("bmm", "linear"):
        assert 100 * ape[op == name].mean() < 12.0, name


def test_fold_gemm_model_never_sees_the_held_out_gpu(
    canonical: Path, tmp_path, monkeypatch
) -> None:
    """A CV fold's per-op model carries a GEMM model fit without the fold's GPU, and per_op's
    hook uses that one (never the packaged model, which saw every GPU)."""
    from boom_ml.timing import gemm as gemm_tiles
    from boom_ml.timing.gemm import gemm_model_for
    from training import train_gemm
    from training.fold_heads import FoldHeads
    from training.kernel_rows import load_training_data

    full = train_gemm.load_config()
    small = {**full, "lgb": {**full["lgb"], "n_estimators": 10}}  # the packaged variant, tiny
    monkeypatch.setattr(train_gemm, "load_config", lambda **_kw: small)
    monkeypatch.setattr(gemm_tiles, "STEP_TIMES", True)  # folds fit GEMM models only then

    data = canonical
    kernels = load_training_data({"dir": str(data), "sources": ["neusight_train", "neusight_test"],
                                  "exclude_gpus": {"p4": "throttled"}, "max_rows_per_head": 600},
                                 log=lambda _m: None)  # fmt: skip
    kernels = kernels[kernels["family"] == "gemm"].reset_index(drop=True)
    settings = {"n_estimators": 5, "learning_rate": 0.1, "max_train_rows": None, "min_rows": 50,
                "params": {}, "gpu_features": None, "n_jobs": 1, "seed": 0}  # fmt: skip
    model = FoldHeads(kernels, settings, tmp_path, log=lambda _m: None).without("t4")
    assert model.gemm.meta["held_out_gpu"] == "t4"
    assert model.gemm.meta["train_rows"] == int((kernels["gpu_id"] != "t4").sum())
    assert gemm_model_for(model) is model.gemm
    # score_fold: the fold's GEMM model on the held-out GPU's fp32 rows, as MAPE per op.
    from boom_ml.gpus import get_gpu

    rows = kernels[kernels["gpu_id"].eq("t4") & kernels["dtype"].eq("float32")]
    rows = rows.reset_index(drop=True)
    pred = model.gemm.predict_ms(train_gemm.gemm_features(rows, {"t4": get_gpu("t4")}))
    ape = np.abs(pred / rows["latency_ms"].to_numpy() - 1)
    scores = {(sc["op"], sc["rows"]): sc for sc in train_gemm.score_fold(kernels, "t4", model.gemm)}
    for op in ("bmm", "linear"):
        sel = rows["op"].eq(op).to_numpy()
        assert scores[(op, "all")]["n"] == sel.sum() > 0
        assert scores[(op, "all")]["mape"] == pytest.approx(100 * ape[sel].mean(), rel=1e-12)
    assert train_gemm.score_fold(kernels, "rtx-3090", model.gemm) == []
    line = train_gemm.fold_line(train_gemm.score_fold(kernels, "t4", model.gemm))
    assert line.startswith(f"bmm {scores[('bmm', 'all')]['mape']:.1f} (")
    assert f"linear {scores[('linear', 'all')]['mape']:.1f} (" in line


@pytest.mark.skipif(not (PACKAGED_DIR / "model.json").exists(), reason="no packaged GEMM model")
def test_packaged_model_times_the_traced_gemms(monkeypatch) -> None:
    """per_op's hook: with the packaged heads, GEMM nodes of a traced step are timed by the
    packaged tile/wave model and no other node is; with gemm.STEP_TIMES off (the switch the
    GNN is retrained with) the heads time them."""
    from tiny_models import tiny_transformer

    from boom_ml.specs import StepSpec
    from boom_ml.timing import gemm as gemm_tiles
    from boom_ml.timing.per_op import predict_nodes
    from boom_ml.trace.step import trace_step

    graph = trace_step(tiny_transformer(), StepSpec(batch_size=2, seq_len=16, optimizer="none"))
    monkeypatch.setattr(gemm_tiles, "STEP_TIMES", False)
    assert not (predict_nodes(graph.nodes, get_gpu("l4"))["method"] == METHOD).any()
    monkeypatch.setattr(gemm_tiles, "STEP_TIMES", True)
    pred = predict_nodes(graph.nodes, get_gpu("t4"))  # another GPU: no cached features
    gemm = (graph.nodes["family"] == "gemm").to_numpy()
    assert (pred["method"][gemm] == METHOD).all()
    assert not (pred["method"][~gemm] == METHOD).any()
    assert (pred["ms"][gemm] > 0).all()


def test_held_out_coverage_calibrates_on_the_other_gpus_only() -> None:
    """Synthetic residuals: GPU c's interval comes from a and b (|log ratio| <= 1), so its
    rows at -5 and +5 fall outside and its rows at 0 inside."""
    from training.train_gemm import held_out_coverage

    resid = {
        "a": np.zeros(10),
        "b": np.linspace(-1.0, 1.0, 11),
        "c": np.array([-5.0, 0.0, 0.0, 5.0]),
    }
    kernels = pd.DataFrame({
        "gpu_id": ["a"] * 10 + ["b"] * 11 + ["c"] * 4,
        "op": ["bmm"] * 21 + ["bmm", "linear", "mm", "bmm"],
        "dtype": ["float32"] * 24 + ["float16"],
    })  # fmt: skip
    table = held_out_coverage(resid, kernels).set_index("gpu")
    c = table.loc["c"]
    assert c["rows"] == 4 and c["fp32 bmm/linear rows"] == 2
    assert c["coverage %"] == 50.0 and c["fp32 bmm/linear coverage %"] == 50.0  # -5 out, 0 in
    assert np.exp(-1.0) <= c["p10"] < 1.0 < c["p90"] <= np.exp(1.0)
    assert table.loc["a", "coverage %"] == 100.0  # zeros sit inside any interval around 0


def test_the_p10_is_floored_at_the_plain_roofline_too() -> None:
    """8192^3 fp32 on an A100-80GB SXM: at least 2 * 8192^3 / 19.5e12 s = 56.39 ms (+ the
    launch); p10 was the prediction x 0.77 (46.7 ms, 121 % of the peak)."""
    rows = pd.DataFrame({"op": ["mm", "mm"], "b": [1, 1], "m": [8192] * 2, "n": [8192] * 2,
                         "k": [8192] * 2, "dtype": ["float32", "float16"]})  # fmt: skip
    gpu = get_gpu("a100-80gb-sxm")
    pred = GemmModel.load(PACKAGED_DIR).predict_rows(rows, gpu)
    floor = 2 * 8192**3 / np.array([19.5e12, 312e12]) * 1e3 + 0.005
    assert (pred["p10_ms"].to_numpy() >= floor - 1e-9).all()
    assert pred["p10_ms"].iloc[0] == pytest.approx(floor[0], rel=1e-9)  # the floor binds
    assert (pred["p10_ms"] <= pred["pred_ms"]).all()
