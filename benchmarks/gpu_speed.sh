#!/bin/bash
# Issue 43, device calls for its speed points: memory as speed (the 1.5B and 8B at 16k, all layers, checkpointing on,
# the auto budget against no plan), the offload's cost at 64k (8B, 8 layers, every input offloaded against every
# layer checkpointed on the device) and the Megatron-Core step without checkpointing against Inductor.
# usage (on the device, repo root; megatron-core's wheel in .whl2): bash benchmarks/gpu_speed.sh OUTDIR [all|memory|rest]
#   memory: the four 16k runs (about 6 minutes on an H200; the 8B's auto plan needs an H200's memory to keep layers);
#   rest: 64k and Megatron (about 5 minutes); all: both (past one 10-minute call)
set -u
out=${1:?OUTDIR}
part=${2:-rest}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$part" != rest ]; then
for m in 1.5b 8b; do
  for b in 0 auto; do
    python3 benchmarks/e2e.py --models $m --lengths 16384 --methods tilecompile --checkpointing on --repeats 3 \
      --csv "$out/e2e_memory_plan.csv" --env TILECOMPILE_MEMORY_BUDGET=$b,TILECOMPILE_LOG=info --budget 150 2>&1 \
      | grep -v "^W1\|Warning" | grep "ok=\|kept whole" | cut -c1-300 | tail -3
  done
done
fi
if [ "$part" != memory ]; then
e2e() { python3 benchmarks/e2e.py --models 8b --layers 8 --lengths 65536 --methods tilecompile --checkpointing on --repeats 3 --csv "$out/e2e_64k.csv" "$@" 2>&1 | grep -v "^W1\|Warning" | tail -4; }
e2e --env TILECOMPILE_MEMORY_BUDGET=0 --budget 110
e2e --env TILECOMPILE_OFFLOAD=all --budget 110
python3 -m pip install -q --no-index --no-deps --target /tmp/mc .whl2/*.whl >/dev/null 2>&1
for m in inductor tilecompile; do
  PYTHONPATH=/tmp/mc timeout 170 python3 benchmarks/bench_megatron.py --method $m --lengths 2048 --repeats 3 2>&1 | grep "^{" | tee -a "$out/megatron.jsonl"
done
fi
