#!/bin/bash
# Issue 43, one device call: the long-context probes with every checkpointed input offloaded (layers cut, projected
# in RESULTS.md). usage (on the device, repo root): bash benchmarks/gpu_long.sh OUTDIR
set -u
out=${1:?OUTDIR}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
e2e() { python3 benchmarks/e2e.py --methods tilecompile --checkpointing on --probe --csv "$out/e2e_long.csv" "$@" 2>&1 | grep -v "^W1\|Warning" | tail -8; }
e2e --models 8b --layers 4 --lengths 393216 --env TILECOMPILE_OFFLOAD=all,TILECOMPILE_LOG=info --budget 200
e2e --models 8b --layers 2 --lengths 393216 --env TILECOMPILE_OFFLOAD=all --budget 110
e2e --models 1.5b --layers 4 --lengths 786432 --env TILECOMPILE_OFFLOAD=all,TILECOMPILE_LOG=info --budget 230
