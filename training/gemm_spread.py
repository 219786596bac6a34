"""How much a GEMM prediction for a GPU nobody measured rests on any one measured GPU.

    python -m training.gemm_spread [gpus=h100-sxm,h200] [variant=NAME]

For a few reference GEMMs, the throughput (TFLOPS) the tile/wave GEMM model predicts on
each target GPU: the packaged model's, and that of every leave-one-GPU-out fold model (the
same variant fit without one training GPU's rows: the step check's fold models, cached in
``data/fold_heads``; a missing one is fit, about a minute each). Inside the measured range a
fold barely moves a prediction; for a GPU beyond it (more SMs, bandwidth and peak than any
measured card), the trees place it by splits that one training GPU can move, and the spread
across folds shows by how much. ``variant=NAME`` adds that ``configs/train_gemm.yaml``
variant fit on every GPU's rows (about a minute). Nothing is fitted to the targets: no
Hopper row exists here.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import pandas as pd

from boom_ml.gpus import get_gpu
from boom_ml.timing.gemm import GemmModel, gemm_features

DEFAULT_TARGETS = ("h100-sxm", "h200")
# (op, B, M, N, K, dtype) in NeuSight's convention: large, medium and small GEMMs.
SHAPES = (
    ("linear", 1, 8192, 8192, 8192, "float32"),
    ("linear", 1, 2048, 1024, 4096, "float32"),
    ("linear", 1, 1024, 1024, 1024, "float32"),
    ("bmm", 16, 512, 64, 512, "float32"),
    ("linear", 1, 8192, 8192, 8192, "float16"),
)


def shape_rows(gpu: str) -> pd.DataFrame:
    rows = pd.DataFrame(SHAPES, columns=["op", "b", "m", "n", "k", "dtype"])
    return rows.assign(gpu_id=gpu, family="gemm")


def tflops(models: Mapping[str, GemmModel], targets: list[str]) -> pd.DataFrame:
    """One row per (target, model): achieved TFLOPS on each reference shape."""
    out = []
    for gpu in targets:
        rows = shape_rows(gpu)
        feats = gemm_features(rows, {gpu: get_gpu(gpu)})
        flops = 2.0 * rows[["b", "m", "n", "k"]].prod(axis=1).to_numpy(dtype=float)
        for name, model in models.items():
            achieved = flops / (model.predict_ms(feats) * 1e-3) / 1e12
            out.append({"gpu": gpu, "model": name, **dict(zip(labels(), achieved, strict=True))})
    return pd.DataFrame(out)


def labels() -> list[str]:
    return [f"{op} {m}x{n}x{k}{'' if b == 1 else f' b{b}'} {dt}" for op, b, m, n, k, dt in SHAPES]


def spread(table: pd.DataFrame) -> pd.DataFrame:
    """Per target and shape: the packaged model's TFLOPS and the folds' min and max."""
    folds = table[table["model"].str.startswith("without ")]
    packaged = table[table["model"] == "packaged"].set_index("gpu")
    lines = []
    for gpu, sub in folds.groupby("gpu", sort=False):
        for shape in labels():
            low, high = sub[shape].min(), sub[shape].max()
            lines.append({"gpu": gpu, "shape": shape, "packaged": packaged.loc[gpu, shape],
                          "folds min": low, "folds max": high,
                          "fold at min": sub.loc[sub[shape].idxmin(), "model"],
                          "max / min": high / low})  # fmt: skip
    return pd.DataFrame(lines)


def fold_models() -> dict[str, GemmModel]:
    """The packaged model and one fold model per training GPU (fit where not cached)."""
    from boom_ml.timing.gemm import load_gemm_model
    from training.fold_heads import FoldHeads
    from training.train_gemm import fold_gemm

    heads = FoldHeads.from_train_ops(log=lambda _m: None)
    models: dict[str, GemmModel] = {"packaged": load_gemm_model()}
    for gpu in sorted(heads.gpus):
        folder = heads.folder(gpu) / "gemm"
        if not (folder / "model.json").exists():
            print(f"fitting the GEMM model without {gpu} (cached in {folder})", flush=True)
        model = fold_gemm(heads.kernels, [gpu], folder)
        if model is not None:
            models[f"without {gpu}"] = model
    return models


def parse_args(argv: list[str]) -> tuple[list[str], str | None]:
    """(``gpus=a,b``: default the Hopper GPUs; ``variant=NAME``); other arguments are errors."""
    targets, variant = list(DEFAULT_TARGETS), None
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key not in ("gpus", "variant") or not sep:
            raise SystemExit(f"gemm_spread: unknown argument {arg!r}; usage: "
                             "python -m training.gemm_spread [gpus=h100-sxm,h200] [variant=NAME]")  # fmt: skip
        if key == "gpus":
            targets = [get_gpu(g).id for g in value.split(",") if g]
        else:
            variant = value
    return targets, variant


def variant_model(name: str) -> GemmModel:
    """A ``configs/train_gemm.yaml`` variant fit on every GPU's GEMM rows (as packaging does)."""
    from training.kernel_rows import load_training_data
    from training.train_gemm import fit_rows, gemm_rows, load_config

    o = load_config()
    if name not in o["variants"]:
        raise SystemExit(f"gemm_spread: no variant {name!r} in configs/train_gemm.yaml")
    return fit_rows(gemm_rows(load_training_data(o["data"], log=lambda _m: None)), name, o)


def main(argv: list[str] | None = None) -> pd.DataFrame | None:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return None
    targets, variant = parse_args(argv)
    models = fold_models()
    if variant:
        print(f"fitting {variant} on every GPU's rows", flush=True)
        models[f"variant {variant}"] = variant_model(variant)
    table = tflops(models, targets)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print("Predicted TFLOPS per reference GEMM, packaged model and each fold model:")
        print(table.round(1).to_string(index=False))
        print("\nSpread across the fold models:")
        print(spread(table).round(2).to_string(index=False))
    return table


if __name__ == "__main__":
    from boom_ml.config_help import one_line_errors

    with one_line_errors():
        main()
