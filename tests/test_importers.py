"""Importers run on the real public data under the shared data dir (skipped if it is absent)."""

from __future__ import annotations

import csv
import gzip
import statistics

import pandas as pd
import pytest

from data_collection import schema
from data_collection.import_public import SKIPPED, format_counts, import_all
from data_collection.paths import shared_data_dir

SHARED = shared_data_dir()
pytestmark = pytest.mark.skipif(
    not SHARED.is_dir(),
    reason=f"shared data dir {SHARED} is absent (set BOOM_SHARED_DATA to run importer tests)",
)
SOURCES = {
    "kernels": ("neusight_train", "neusight_test", "vidur", "deepbench"),
    "steps": ("neusight_labels", "cnn_step_times", "timm_train", "timm_infer"),
    "memory": ("xmem",),
    "op_profiles": ("neusight_labels",),
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = tmp_path_factory.mktemp("canonical")
    counts = import_all(SHARED, out, progress=False)
    return out, counts


def test_every_source_has_rows(imported) -> None:
    out, counts = imported
    kept = counts[counts["gpu_id"] != SKIPPED]
    for kind, sources in SOURCES.items():
        for source in sources:
            rows = kept[(kept["kind"] == kind) & (kept["source"] == source)]["rows"].sum()
            assert rows > 0, f"{kind}/{source} is empty"
            assert (out / kind / f"{source}.parquet").exists()
    table = format_counts(counts)
    assert "TOTAL" in table and "rtx-3060" in table


def test_every_gpu_id_resolves_in_the_database(imported) -> None:
    from boom_ml.gpus import resolve_gpu_id

    out, counts = imported
    ids = set(counts.loc[counts["gpu_id"] != SKIPPED, "gpu_id"])
    assert {"a100-80gb-pcie", "l4", "rtx-3060", "rtx-3090", "a40", "t4"} <= ids
    for gpu_id in ids:
        assert resolve_gpu_id(gpu_id) == gpu_id


def test_unknown_device_name_is_an_error_not_a_skip() -> None:
    from boom_ml.errors import UnknownGpuError
    from data_collection.importers.common import GpuResolver

    with pytest.raises(UnknownGpuError):
        GpuResolver()("Imaginary Accelerator 9000")


def test_only_amd_rows_are_skipped_and_they_are_counted(imported) -> None:
    _, counts = imported
    skipped = counts[counts["gpu_id"] == SKIPPED]
    assert set(skipped["source"]) <= {"neusight"}
    notes = " ".join(counts.attrs["notes"])
    assert len(skipped)  # NeuSight's MI100, MI210 and MI250 rows
    assert "skipped (non-NVIDIA, not in GPU database)" in notes


def test_neusight_test_split_has_linear_rows_for_l4_and_a100_80gb(imported) -> None:
    out, _ = imported
    kernels = schema.load_kernels(out, sources=["neusight_test"])
    linear = kernels[(kernels["op"] == "linear") & (kernels["split"] == "test")]
    for gpu_id in ("l4", "a100-80gb-pcie"):
        rows = linear[linear["gpu_id"] == gpu_id]
        assert len(rows) == 1040, gpu_id  # SOURCE.md: 1040 linear test rows per GPU
    assert (kernels["dtype"] == "float32").all() and (kernels["direction"] == "forward").all()


def test_neusight_linear_shapes_follow_neusight_convention(imported) -> None:
    out, _ = imported
    path = SHARED / "neusight" / "ops_train" / "linear.csv.gz"
    with gzip.open(path, "rt", newline="") as fh:
        first = next(csv.DictReader(fh))
    kernels = schema.load_kernels(out, sources=["neusight_train"])
    row = kernels[kernels["op"] == "linear"].iloc[0]
    assert [row["b"], row["m"], row["n"], row["k"]] == [int(first[c]) for c in "BMNK"]
    assert row["latency_ms"] == pytest.approx(float(first["Latency"]))


def test_xmem_has_229_runs_with_40_ooms(imported) -> None:
    out, _ = imported
    memory = schema.load_memory(out)
    assert len(memory) == 229
    assert int(memory["real_oom"].sum()) == 40
    assert (memory["gpu_id"] == "rtx-3060").all()
    assert int(memory["llmem_failed"].sum()) == 23  # SOURCE.md: LLmem -1 on 23 T5 rows
    assert memory.loc[memory["llmem_failed"], "llmem_memory_bytes"].isna().all()


def test_cnn_step_median_matches_hand_computed_median(imported) -> None:
    out, _ = imported
    times = []
    with gzip.open(SHARED / "cnn_step_times" / "cnn_train_step_times_long.csv.gz", "rt") as fh:
        for rec in csv.DictReader(fh):
            if (rec["gpu"], rec["model"], rec["precision"]) == ("TITAN V", "resnet50", "float"):
                times.append(float(rec["step_time_ms"]))
    assert len(times) == 20  # 2018 script: 20 timed iterations, one file
    steps = schema.load_steps(out, sources=["cnn_step_times"])
    row = steps[
        (steps["device_name"] == "TITAN V")
        & (steps["model"] == "torchvision:resnet50")
        & (steps["precision"] == "float32")
    ]
    assert len(row) == 1
    assert row["step_time_ms"].iloc[0] == pytest.approx(statistics.median(times))
    assert row["n_iterations"].iloc[0] == 20
    assert row["optimizer"].iloc[0] == "none" and row["phase_scope"].iloc[0] == "fwd+bwd"


def test_neusight_labels_train_and_inference_rows(imported) -> None:
    out, _ = imported
    steps = schema.load_steps(out, sources=["neusight_labels"])
    train = steps[steps["phase_scope"] == "fwd+bwd"]
    infer = steps[steps["phase_scope"] == "fwd"]
    assert len(train) and len(infer)
    single = train[train["num_gpus"] == 1]
    assert (single["fw_ms"] + single["bw_ms"] - single["step_time_ms"]).abs().max() < 1.0
    assert set(steps.loc[steps["variant"] != "", "variant"]) <= {"fusion", "dp4", "tp4", "pp4_1"}
    assert "hf:neusight/model_configs/gpt3_xl.json" in set(steps["model"])


def test_reimport_rewrites_identical_files(imported) -> None:
    out, _ = imported
    files = [out / "memory" / "xmem.parquet", out / "steps" / "cnn_step_times.parquet"]
    before = [f.read_bytes() for f in files]
    import_all(SHARED, out, only=["xmem", "cnn_step_times"], progress=False)
    assert [f.read_bytes() for f in files] == before


def test_all_canonical_datasets_load_and_validate(imported) -> None:
    out, _ = imported
    for kind in SOURCES:
        df = schema.load(kind, out)
        assert list(df.columns) == schema.columns(kind)
        assert isinstance(df, pd.DataFrame) and len(df) > 0
