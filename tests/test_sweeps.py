"""The device commands printed in data_collection/sweeps/README.md, run as written.

A lent GPU gives one session 15 minutes: a command that breaks there costs the measurements.
The priority plan's block had lost a line continuation, so bash ran the default plan and then
failed on ``--sweep`` (exit 127). Here both blocks run through bash with ``nvidia-smi`` and the
runner's Python stubbed, ``$OUT`` and the shard folder under a temporary directory.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "data_collection" / "sweeps" / "README.md"


def _device_blocks() -> list[str]:
    text = README.read_text().split("## On the device machine", 1)[1]
    return [b for b in re.findall(r"```\n(.*?)```", text, flags=re.S) if "$OUT" in b]


@pytest.mark.parametrize(
    ("index", "sweeps"),
    [
        (0, []),
        (
            1,
            [
                "steps=h200_neusight_steps.yaml",
                "kernels=h200_neusight_kernels.yaml",
                "steps=h200_steps.yaml",
                "kernels=h200_kernels.yaml",
            ],
        ),
    ],  # fmt: skip
)
def test_the_device_commands_run_the_sweeps_they_name(tmp_path: Path, index, sweeps) -> None:
    blocks = _device_blocks()
    assert len(blocks) == 2
    shards = tmp_path / "boom_sweep"
    block = blocks[index].replace("-C /tmp boom_sweep", f"-C {tmp_path} boom_sweep")
    block = block.replace("/tmp/boom_sweep", str(shards))
    stubs, out = tmp_path / "bin", tmp_path / "out"
    stubs.mkdir()
    out.mkdir()
    (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'name, driver_version'\necho 'stub, 0'\n")
    args = tmp_path / "runner_args"
    (stubs / "python-stub").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > {args}\necho "{{}}" > "$2/environment.json"\n'
    )
    for stub in ("nvidia-smi", "python-stub"):
        (stubs / stub).chmod(0o755)
    env = {**os.environ, "OUT": str(out), "PYTHON": str(stubs / "python-stub"),
           "PATH": f"{stubs}:{os.environ['PATH']}"}  # fmt: skip
    done = subprocess.run(["bash", "-c", block], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    got = args.read_text().split("\n")[:-1]
    assert got[0] == "data_collection/sweeps/run_gpu_sweep.py" and got[1] == str(shards)
    assert [got[i + 1] for i, a in enumerate(got) if a == "--sweep"] == sweeps
    assert sorted(p.name for p in out.iterdir()) == ["nvidia-smi.csv", "shards.tgz", "sweep.log"]
