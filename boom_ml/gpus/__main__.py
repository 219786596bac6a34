"""``python -m boom_ml.gpus [NAME_OR_YAML ...]``: print the GPU table, or every field of some GPUs."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from boom_ml.errors import BoomError
from boom_ml.gpus import GpuSpec, all_gpus, get_gpu, gpu_aliases, parse_gpu_list
from boom_ml.gpus.spec import GIB


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def gpu_table(gpus: list[GpuSpec]) -> Table:
    """Rich table with one row per GPU (the columns people compare when picking a GPU)."""
    table = Table(title=f"boom-ml GPU database ({len(gpus)} GPUs; TFLOPS dense)")
    for header, justify in [
        ("id", "left"),
        ("name", "left"),
        ("arch", "left"),
        ("mem GiB", "right"),
        ("GB/s", "right"),
        ("fp32", "right"),
        ("fp16", "right"),
        ("bf16", "right"),
        ("$/h", "right"),
    ]:
        table.add_column(header, justify=justify, no_wrap=True, overflow="ellipsis")
    for g in gpus:
        table.add_row(
            g.id,
            g.name,
            g.architecture,
            _num(g.memory_bytes / GIB),
            _num(g.memory_bandwidth_gbs, 0),
            _num(g.fp32_tflops),
            _num(g.fp16_tflops),
            _bf16(g),
            _num(g.price_usd_per_hour, 2),
        )
    if any(g.bf16_tflops is None and g.bf16_tensor_cores for g in gpus):
        table.caption = (
            "bf16 *: no sheet figure; Ampere and later run bf16 on their tensor cores at the "
            "fp16 rate, which predictions use"
        )
    return table


def _bf16(gpu: GpuSpec) -> str:
    """The sheet's bf16 rate, else the fp16 rate predictions use where bf16 tensor cores run it
    (marked), else "-" (no bf16 tensor cores: bf16 runs at the fp32 rate)."""
    if gpu.bf16_tflops is not None or not gpu.bf16_tensor_cores:
        return _num(gpu.bf16_tflops)
    return f"{_num(gpu.bf16_peak_tflops)}*"


def gpu_detail(gpu: GpuSpec) -> Table:
    """Two-column field/value table for one GPU, sources included."""
    table = Table(title=gpu.id, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for field, value in gpu.to_dict().items():
        table.add_row(field, "-" if value is None else str(value))
    try:
        # a user YAML spec has no packaged aliases, even under a packaged GPU's id (an A100-like
        # spec named l4 had been listed with the L4's: a hunt)
        if get_gpu(gpu.id) == gpu:
            table.add_row("aliases", "; ".join(gpu_aliases(gpu.id)))
    except BoomError:
        pass
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m boom_ml.gpus", description=__doc__)
    parser.add_argument("gpus", nargs="*", help="GPU ids/names or .yaml specs to show in full")
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        # Piped output would otherwise be squeezed into 80 columns and wrap every name.
        console = Console(width=160)
    try:
        if not args.gpus or [n.lower() for n in args.gpus] == ["all"]:  # as gpu=all says
            console.print(gpu_table(all_gpus()))
            return 0
        # every name checked before any is shown, each GPU once, as predict's gpu= does
        # (an unknown third name had failed after two tables of the same L4: a hunt)
        for gpu in parse_gpu_list(list(args.gpus)):
            console.print(gpu_detail(gpu))
    except BoomError as err:  # one line on stderr, as boom_ml.predict's
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
