#!/bin/bash
# Issue 43, one device call: the offload's cost at 64k (8B, 8 layers, every input offloaded against every layer
# checkpointed on the device) and the Megatron-Core step without checkpointing against Inductor.
# usage (on the device, repo root; megatron-core's wheel in .whl2): bash benchmarks/gpu_speed.sh OUTDIR
set -u
out=${1:?OUTDIR}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
e2e() { python3 benchmarks/e2e.py --models 8b --layers 8 --lengths 65536 --methods tilecompile --checkpointing on --repeats 3 --csv "$out/e2e_64k.csv" "$@" 2>&1 | grep -v "^W1\|Warning" | tail -4; }
e2e --env TILECOMPILE_MEMORY_BUDGET=0 --budget 110
e2e --env TILECOMPILE_OFFLOAD=all --budget 110
python3 -m pip install -q --no-index --no-deps --target /tmp/mc .whl2/*.whl >/dev/null 2>&1
for m in inductor tilecompile; do
  PYTHONPATH=/tmp/mc timeout 170 python3 benchmarks/bench_megatron.py --method $m --lengths 2048 --repeats 3 2>&1 | grep "^{" | tee -a "$out/megatron.jsonl"
done
