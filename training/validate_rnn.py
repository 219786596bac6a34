"""Check the cuDNN RNN time model on DeepBench's measured RNN training kernels.

    python -m training.validate_rnn              # packaged models and leave-one-GPU-out folds
    python -m training.validate_rnn --no-folds   # packaged models only

Data: ``shared/data/deepbench/*_rnn_{vanilla,lstm,gru}.csv`` (SOURCE.md): one-layer,
unidirectional cuDNN RNNs with ``CUDNN_SKIP_INPUT`` (DeepBench's ``code/nvidia/rnn_bench.cu``:
the input, as wide as the hidden state, enters the gates without an input GEMM; the sheets'
TFLOPS columns count 2 x gates x H x H x N x T forward, which agrees), forward and backward
(wrt inputs + wrt weights) times in ms, the mean of 100 back-to-back calls, on a V100
(cuDNN 7.6), P100, GTX 1080 Ti and TITAN Xp (cuDNN 6.0). No model was ever fitted on these
rows. Each row becomes the two nodes a traced ``nn.LSTM``/``GRU``/``RNN`` step holds
(``boom_ml.trace.rnn``), timed as a step's nodes are (``timing.per_op``: the GEMM tile/wave
model and the elementwise head over ``trace.rnn_kernels``' kernels, here without the input
GEMMs that PyTorch's ``CUDNN_LINEAR_INPUT`` adds).

Two columns per GPU: ``packaged`` (the shipped models, whose GEMM and elementwise fits saw
these GPUs' GEMM and elementwise kernel rows, not these RNN rows) and ``held out`` (the fold
models of ``training/fold_heads.py``, fit without any kernel row of that GPU). The vanilla
rows are timed as ReLU RNNs (DeepBench's vanilla cell; tanh times alike here).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import pandas as pd

from boom_ml.gpus import get_gpu
from boom_ml.trace import rnn_kernels

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "deepbench"
GPUS = {
    "V100": "v100-sxm2-16gb",
    "P100": "p100-pcie-16gb",
    "1080Ti": "gtx-1080-ti",
    "TitanXp": "titan-xp",
}  # fmt: skip  (data_collection/importers/deepbench.py's ids)
MODES = {"lstm": "lstm", "gru": "gru", "vanilla": "rnn_relu"}
DTYPES = {"fp32": "float32", "fp16_mixed": "float16", "fp16_pseudo": "float16"}
FILE_RE = re.compile(
    r"^(?P<gpu>\w+?)_(?P<prec>fp32|fp16_mixed|fp16_pseudo)_rnn_(?P<mode>\w+)\.csv$"
)


def load_rows(data: Path = DATA) -> pd.DataFrame:
    """One row per measured RNN: gpu, precision, mode, hidden, batch, steps, fwd_ms, bwd_ms."""
    parts = []
    for path in sorted(data.glob("*_rnn_*.csv")):
        m = FILE_RE.match(path.name)
        if not m or m["gpu"] not in GPUS:
            continue
        raw = pd.read_csv(path).rename(columns=str.lower)  # the sheets differ in case
        num = {c: pd.to_numeric(raw[c], errors="coerce") for c in raw.columns if "msec" in c}
        bwd = (num["time backward (msec)"] if "time backward (msec)" in num
               else num["time backward wrt inputs (msec)"] + num["time backward wrt weights (msec)"])  # fmt: skip
        parts.append(pd.DataFrame({
            "gpu": GPUS[m["gpu"]], "precision": m["prec"], "mode": MODES[m["mode"]],
            "hidden": raw["hidden units"].astype(int), "batch": raw["n"].astype(int),
            "steps": raw["timesteps"].astype(int), "fwd_ms": num["time forward (msec)"],
            "bwd_ms": bwd,
        }).dropna(subset=["fwd_ms", "bwd_ms"]))  # fmt: skip
    return pd.concat(parts, ignore_index=True)


def predict(rows: pd.DataFrame, model=None) -> pd.DataFrame:  # noqa: ANN001
    """``fwd_pred`` and ``bwd_pred`` (ms) for every row, with ``model`` (None: packaged)."""
    from boom_ml.timing.library_calls import library_ms, library_rows

    fwd, bwd = [], []
    for _, row in rows.iterrows():
        h = int(row.hidden)
        shape = rnn_kernels.RnnShape(str(row["mode"]), int(row.steps), int(row.batch), h, h,
                                     0, 1, 1, linear_input=False)  # fmt: skip
        gpu, dtype = get_gpu(row.gpu), DTYPES[row.precision]
        for out, backward in ((fwd, False), (bwd, True)):
            kernels = library_rows(rnn_kernels.kernel_rows(shape, backward), dtype,
                                   "backward" if backward else "forward")  # fmt: skip
            out.append(library_ms(kernels, gpu, model))
    return rows.assign(fwd_pred=fwd, bwd_pred=bwd)


def _ape(pred: pd.Series, meas: pd.Series) -> pd.Series:
    return (pred / meas - 1).abs() * 100


def table(scored: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """MAPE % of forward and backward per GPU and precision, one column pair per model."""
    out = None
    for name, df in scored.items():
        g = df.groupby(["gpu", "precision"])
        part = pd.DataFrame({
            "rows": g.size(),
            f"fwd {name}": g.apply(lambda d: _ape(d.fwd_pred, d.fwd_ms).mean()),
            f"bwd {name}": g.apply(lambda d: _ape(d.bwd_pred, d.bwd_ms).mean()),
            f"median pred/meas {name}": g.apply(
                lambda d: np.median(np.r_[d.fwd_pred / d.fwd_ms, d.bwd_pred / d.bwd_ms])),
        })  # fmt: skip
        out = part if out is None else out.join(part.drop(columns="rows"))
    return out.round(2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--no-folds", action="store_true", help="packaged models only")
    args = ap.parse_args(argv)
    rows = load_rows()
    scored = {"packaged": predict(rows)}
    if not args.no_folds:
        from training.fold_heads import FoldHeads

        folds = FoldHeads.from_train_ops(log=lambda m: print(m, flush=True))
        parts = [predict(part, folds.without(gpu)) for gpu, part in rows.groupby("gpu")]
        scored["held out"] = pd.concat(parts).loc[rows.index]
    tab = table(scored)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(tab.to_string())
    for name, df in scored.items():
        for label, part in (("all", df), ("fp32", df[df["precision"] == "fp32"])):
            print(f"{name}: {label} {len(part)} rows: forward MAPE "
                  f"{_ape(part.fwd_pred, part.fwd_ms).mean():.1f} %, backward "
                  f"{_ape(part.bwd_pred, part.bwd_ms).mean():.1f} %")  # fmt: skip


if __name__ == "__main__":
    from boom_ml.config_help import one_line_errors

    with one_line_errors():
        main()
