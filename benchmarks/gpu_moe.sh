#!/bin/bash
# Issue 42, one device call: the Qwen3-30B-A3B step (4 of 48 layers, checkpointing on) with the experts left alone
# against tiled (the routing-weight multiply in the op since ae29d70), no memory plan for either, then the op alone.
# usage (on the device, repo root): bash benchmarks/gpu_moe.sh OUTDIR
set -u
out=${1:?OUTDIR}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
e2e() { python3 benchmarks/e2e.py --models 30b-a3b --layers 4 --checkpointing on --lengths 8192,32768 --methods tilecompile --repeats 2 --csv "$out/e2e_moe.csv" "$@" 2>&1 | grep -v "^W1\|Warning" | tail -5; }
e2e --env TILECOMPILE_MEMORY_BUDGET=0 --note "experts left alone (check_pays)" --budget 170
e2e --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_MIN_TOKENS=0 --note "experts tiled, routing weight in the op" --budget 170
timeout 150 python3 benchmarks/bench_moe_op.py --repeats 5 --memory-tokens "" --csv "$out/moe_op.csv" 2>&1 | grep -v "^W1\|Warning" | tail -12
