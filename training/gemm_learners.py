"""The learners the tile/wave GEMM model is fit with (``configs/train_gemm.yaml``'s variants).

A variant names a learner (``lgb``: LightGBM on shape and GPU features, bagged or one booster
per left-out training GPU; ``lgb_offset``: shape-only trees under a per-GPU offset that is a
ridge line in spec columns; ``mlp``: a softplus MLP) and the GPU feature set. Each returns a
:class:`boom_ml.timing.gemm.GemmModel` that predicts log(time / tiled bound).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from boom_ml.timing.gemm import (
    GPU_FEATURE_SETS,
    MULTI_TILE_FEATURES,
    SHAPE_FEATURES,
    GemmModel,
)


def fit_variant(
    feats: pd.DataFrame, y: np.ndarray, variant: dict, o: dict, gpus: np.ndarray | None = None
) -> GemmModel:
    """One learner on (features, log(t / roof)) rows; ``weight: gpu`` in the variant gives
    every training GPU the same total weight (``gpus``: each row's GPU)."""
    multi = MULTI_TILE_FEATURES if variant.get("multi_tile") else []
    cols = [*SHAPE_FEATURES, *multi, *GPU_FEATURE_SETS[variant["gpu_features"]]]
    x = feats[cols].to_numpy(dtype=float)
    w = None
    if variant.get("weight") == "gpu" and gpus is not None:
        counts = pd.Series(gpus).value_counts()
        w = (1.0 / pd.Series(gpus).map(counts)).to_numpy() * len(gpus) / len(counts)
    if variant["learner"] == "lgb_offset":
        return _fit_offset(feats, y, variant, o, gpus, cols, w)
    if variant["learner"] == "lgb" and variant.get("bags_by") == "gpu" and gpus is not None:
        # One booster per training GPU, fit without that GPU's rows; their mean is the
        # prediction, so no single GPU decides where a GPU beyond the measured range lands.
        held = sorted(set(gpus))
        keep = [np.asarray(gpus) != g for g in held]
        boosters = [_fit_lgb(x[k], y[k], None if w is None else w[k], o, o["seed"] + i)
                    for i, k in enumerate(keep)]  # fmt: skip
        return GemmModel("lgb", cols, boosters=boosters)
    if variant["learner"] == "lgb":
        bags = range(variant.get("bags", 1))
        return GemmModel("lgb", cols, boosters=[_fit_lgb(x, y, w, o, o["seed"] + b) for b in bags])
    floor = np.log(feats["bound_ms"].to_numpy() / feats["roof_ms"].to_numpy())
    mlp = _fit_mlp(x, y, floor, w, o["mlp"], o["seed"], o["threads"])
    return GemmModel("mlp", cols, mlp=mlp)


def _fit_lgb(x: np.ndarray, y: np.ndarray, w: np.ndarray | None, o: dict, seed: int) -> Any:
    import lightgbm as lgb

    params = {**o["lgb"]["params"], "objective": "l2", "verbose": -1,
              "n_jobs": o["threads"], "seed": seed}  # fmt: skip
    return lgb.train(params, lgb.Dataset(x, label=y, weight=w), o["lgb"]["n_estimators"])


def _fit_offset(
    feats: pd.DataFrame,
    y: np.ndarray,
    variant: dict,
    o: dict,
    gpus: np.ndarray | None,
    cols: list[str],
    w: np.ndarray | None,
) -> GemmModel:
    """Shape learner + a per-GPU offset that is a line in a few spec columns.

    The trees see only shape-relative features (``cols``); each training GPU (and precision
    class) gets an offset, alternating with the trees (``rounds``); then a ridge line maps the
    offset groups' spec columns (``offset_features``) to their offsets: a held-out GPU gets
    the line's value, which extrapolates where a tree would return a training GPU's leaf.
    """
    shape_cols = [c for c in cols if not c.startswith("g_")]
    x = feats[shape_cols].to_numpy(dtype=float)
    gcols = GPU_FEATURE_SETS[variant["offset_features"]]
    group = (
        pd.Series(gpus).astype(str) + "/" + feats["tensor_core"].astype(int).astype(str).to_numpy()
    )
    off = np.zeros(len(y))
    for _ in range(variant.get("rounds", 2)):
        booster = _fit_lgb(x, y - off, w, o, o["seed"])
        res = pd.Series(y - booster.predict(x, num_threads=o["threads"]))
        off = res.groupby(group.to_numpy()).transform("median").to_numpy()
    per = pd.DataFrame({"off": off, "group": group.to_numpy()})
    per[gcols] = feats[gcols].to_numpy()
    per = per.groupby("group").first()
    g = per[gcols].to_numpy(dtype=float)
    mean = np.nanmean(g, axis=0)
    g = np.where(np.isnan(g), mean, g)
    std = np.where(g.std(axis=0) > 0, g.std(axis=0), 1.0)
    z = (g - mean) / std
    lam = variant.get("ridge", 1.0)  # in standardised units, one unit per group
    coef_z = np.linalg.solve(
        z.T @ z + lam * np.eye(z.shape[1]), z.T @ (per["off"] - per["off"].mean())
    )
    coef = coef_z / std
    offset = {"features": gcols, "coef": coef.tolist(), "mean": mean.tolist(),
              "intercept": float(per["off"].mean() - mean @ coef)}  # fmt: skip
    return GemmModel("lgb", shape_cols, boosters=[booster], offset=offset)


def _fit_mlp(
    x: np.ndarray,
    y: np.ndarray,
    floor: np.ndarray,
    w: np.ndarray | None,
    m: dict,
    seed: int,
    threads: int,
) -> dict[str, Any]:
    """ReLU MLP, output floor + softplus (never under the roofline), squared log error."""
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    mean = np.nanmean(x, axis=0)
    mean = np.where(np.isnan(mean), 0.0, mean)
    xf = np.where(np.isnan(x), mean, x)
    std = xf.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    xt = torch.tensor((xf - mean) / std, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.float32)
    ft = torch.tensor(floor, dtype=torch.float32)
    wt = torch.tensor(np.ones(len(y)) if w is None else w, dtype=torch.float32)
    sizes = [x.shape[1], *m["hidden"], 1]
    layers: list[torch.nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(net.parameters(), lr=m["lr"], weight_decay=m["weight_decay"])
    steps = m["epochs"] * int(np.ceil(len(yt) / m["batch_size"]))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=m["lr"], total_steps=steps)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(m["epochs"]):
        for idx in torch.randperm(len(yt), generator=gen).split(m["batch_size"]):
            pred = ft[idx] + torch.nn.functional.softplus(net(xt[idx])[:, 0])
            loss = torch.mean(wt[idx] * (pred - yt[idx]) ** 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    lin = [mod for mod in net if isinstance(mod, torch.nn.Linear)]
    return {"mean": mean.tolist(), "std": std.tolist(),
            "layers": [[mod.weight.detach().numpy().T.tolist(), mod.bias.detach().numpy().tolist()]
                       for mod in lin]}  # fmt: skip
