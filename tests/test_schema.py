"""Schema validation: each kind of malformed row is rejected with a message naming it.

Every row here is SYNTHETIC (made up to exercise the validator); none is a measurement.
"""

from __future__ import annotations

import pandas as pd
import pyarrow.parquet as pq
import pytest

from data_collection import schema
from data_collection.schema import SchemaError, validate


def synthetic_kernel_rows(n: int = 3) -> pd.DataFrame:
    """A valid SYNTHETIC kernels frame: n linear rows with made-up latencies."""
    rows = []
    for i in range(n):
        row = dict.fromkeys(schema.columns("kernels"))
        row.update(
            source="synthetic_test", split="", gpu_id="synthetic-gpu", device_name="Synthetic",
            device_kind="gpu", op="linear", family="gemm", dtype="float32", direction="forward",
            b=1, m=8 + i, n=16, k=32, latency_ms=0.5 + i, latency_stat="median",
        )  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)


def synthetic_step_rows(n: int = 2) -> pd.DataFrame:
    """A valid SYNTHETIC steps frame."""
    rows = []
    for i in range(n):
        row = dict.fromkeys(schema.columns("steps"))
        row.update(
            source="synthetic_test", gpu_id="synthetic-gpu", device_name="Synthetic",
            device_kind="gpu", num_gpus=1, model="torchvision:resnet18", model_family="cnn",
            batch_size=4, global_batch_size=4, image_size=224, precision="float32", amp="none",
            checkpointing="none", optimizer="sgd", channels_last=False,
            phase_scope="fwd+bwd+opt", step_time_ms=10.0 + i, oom=False, variant="",
        )  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)


def test_valid_synthetic_rows_pass_and_get_canonical_dtypes() -> None:
    out = validate(synthetic_kernel_rows(), "kernels", "synthetic.parquet")
    assert list(out.columns) == schema.columns("kernels")
    assert str(out["m"].dtype) == "Int64"
    assert out["latency_ms"].dtype == "float64"
    assert out["batch"].isna().all()  # conv fields stay null on a GEMM row
    validate(synthetic_step_rows(), "steps", "synthetic.parquet")


def test_missing_column_is_named() -> None:
    df = synthetic_kernel_rows().drop(columns=["latency_ms"])
    with pytest.raises(SchemaError, match=r"kernels\.parquet: missing column\(s\): latency_ms"):
        validate(df, "kernels", "kernels.parquet")


def test_unexpected_column_is_named() -> None:
    df = synthetic_kernel_rows().assign(latency_us=1.0)
    with pytest.raises(SchemaError, match="unexpected column.*latency_us"):
        validate(df, "kernels", "kernels.parquet")


def test_null_required_field_names_row_and_column() -> None:
    df = synthetic_kernel_rows()
    df.loc[2, "gpu_id"] = None
    with pytest.raises(SchemaError, match=r"^kernels\.parquet row 2: gpu_id is required but null"):
        validate(df, "kernels", "kernels.parquet")


def test_empty_required_string_is_rejected() -> None:
    df = synthetic_kernel_rows()
    df.loc[0, "op"] = "  "
    with pytest.raises(SchemaError, match="row 0: op is required but empty"):
        validate(df, "kernels", "k.parquet")


@pytest.mark.parametrize(
    ("column", "value"),
    [("dtype", "fp8"), ("direction", "sideways"), ("family", "magic"), ("device_kind", "tpu")],
)
def test_bad_enum_value_is_rejected(column: str, value: str) -> None:
    df = synthetic_kernel_rows()
    df.loc[1, column] = value
    with pytest.raises(SchemaError, match=rf"row 1: {column} must be one of .*got '{value}'"):
        validate(df, "kernels", "k.parquet")


def test_bad_step_enums_are_rejected() -> None:
    for column, value in (("amp", "fp8"), ("optimizer", "lion"), ("phase_scope", "bwd")):
        df = synthetic_step_rows()
        df.loc[0, column] = value
        with pytest.raises(SchemaError, match=rf"steps\.parquet row 0: {column} must be one of"):
            validate(df, "steps", "steps.parquet")


def test_negative_latency_is_rejected_with_value() -> None:
    df = synthetic_kernel_rows(20)
    df.loc[17, "latency_ms"] = -1.0
    with pytest.raises(
        SchemaError, match=r"^kernels\.parquet row 17: latency_ms must be > 0, got -1\.0$"
    ):
        validate(df, "kernels", "kernels.parquet")


def test_zero_latency_is_rejected() -> None:
    df = synthetic_kernel_rows()
    df.loc[0, "latency_ms"] = 0.0
    with pytest.raises(SchemaError, match="row 0: latency_ms must be > 0"):
        validate(df, "kernels", "k.parquet")


def test_non_positive_step_time_is_rejected() -> None:
    df = synthetic_step_rows()
    df.loc[1, "step_time_ms"] = -3.0
    with pytest.raises(SchemaError, match="row 1: step_time_ms must be > 0, got -3.0"):
        validate(df, "steps", "steps.parquet")


def test_non_numeric_shape_is_rejected() -> None:
    df = synthetic_kernel_rows().astype({"m": object})
    df.loc[1, "m"] = "big"
    with pytest.raises(SchemaError, match=r"row 1: m must be numeric, got 'big'"):
        validate(df, "kernels", "k.parquet")


def test_fractional_shape_is_rejected() -> None:
    df = synthetic_kernel_rows().astype({"k": float})
    df.loc[0, "k"] = 3.5
    with pytest.raises(SchemaError, match="row 0: k must be an integer, got 3.5"):
        validate(df, "kernels", "k.parquet")


def test_negative_shape_is_rejected() -> None:
    df = synthetic_kernel_rows()
    df.loc[2, "n"] = -4
    with pytest.raises(SchemaError, match="row 2: n must be >= 0, got -4"):
        validate(df, "kernels", "k.parquet")


def test_family_shape_fields_are_required() -> None:
    df = synthetic_kernel_rows()
    df.loc[1, "k"] = None
    with pytest.raises(SchemaError, match="row 1: k is required for family 'gemm' but null"):
        validate(df, "kernels", "k.parquet")


def test_bad_bool_is_rejected() -> None:
    df = synthetic_step_rows().astype({"oom": object})
    df.loc[0, "oom"] = "maybe"
    with pytest.raises(SchemaError, match="row 0: oom must be true/false, got 'maybe'"):
        validate(df, "steps", "steps.parquet")


def test_step_without_time_needs_oom() -> None:
    df = synthetic_step_rows()
    df.loc[1, "step_time_ms"] = None
    with pytest.raises(SchemaError, match="row 1: step_time_ms is required when oom is false"):
        validate(df, "steps", "steps.parquet")
    df.loc[1, "oom"] = True  # an OOM step legitimately has no time
    validate(df, "steps", "steps.parquet")


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(SchemaError, match="unknown dataset kind"):
        validate(synthetic_kernel_rows(), "kernal", "x")


def test_write_and_load_round_trip(tmp_path) -> None:
    path = tmp_path / "kernels" / "synthetic_test.parquet"
    assert schema.write_dataset(synthetic_kernel_rows(), "kernels", path) == 3
    first = path.read_bytes()
    schema.write_dataset(synthetic_kernel_rows(), "kernels", path)
    assert path.read_bytes() == first  # idempotent bytes
    assert pq.read_schema(path).equals(schema.arrow_schema("kernels"), check_metadata=False)
    loaded = schema.load_kernels(tmp_path, sources=["synthetic_test"])
    assert len(loaded) == 3 and loaded["m"].tolist() == [8, 9, 10]
    with pytest.raises(FileNotFoundError, match="nope"):
        schema.load_kernels(tmp_path, sources=["nope"])


def test_loader_names_the_bad_file(tmp_path) -> None:
    bad = synthetic_kernel_rows()
    bad.loc[1, "latency_ms"] = -2.0
    path = tmp_path / "kernels" / "broken.parquet"
    path.parent.mkdir()
    bad.to_parquet(path)  # bypasses write_dataset's validation on purpose
    with pytest.raises(SchemaError, match=r"broken\.parquet row 1: latency_ms must be > 0"):
        schema.load_kernels(tmp_path)
