#!/usr/bin/env bash
# The prepared GPU sweep, end to end: kernels then steps, shards written under OUTDIR.
#   bash data_collection/sweeps/run_gpu_sweep.sh OUTDIR [extra args for run_gpu_sweep.py]
# Sized for < 8 minutes on one H100/H200 (overall budget 7.5 min, see README.md here).
# A rerun with the same OUTDIR resumes: configurations already in its shards are skipped.
set -euo pipefail
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then  # --help is no OUTDIR (mkdir printed its own help)
  echo "usage: $0 OUTDIR [--budget-min M] [--margin-min M] [--sweep KIND=FILE ...] [--device cuda|cpu] [--dry-run]" >&2
  [ $# -ge 1 ] && [[ "$1" == "-h" || "$1" == "--help" ]] && exit 0
  exit 2
fi
OUTDIR=$1
shift
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
# The repository itself is the package (no install on the GPU machine).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
case "$OUTDIR" in *://*) ;; *) mkdir -p "$OUTDIR" ;; esac  # URLs: the writer creates them
exec "$PY" data_collection/sweeps/run_gpu_sweep.py "$OUTDIR" "$@"
