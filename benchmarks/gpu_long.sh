#!/bin/bash
# Issue 43, one device call (about 9 minutes on an H200): the offload probe (offloaded layers in regions against flat,
# against the device plans), the offload's peak and speed at 64k (8B, 8 layers), then the long probes with every
# checkpointed input offloaded, layers cut (projected in RESULTS.md).
# usage (on the device, repo root): bash benchmarks/gpu_long.sh OUTDIR [short|long|all|mid]
#   short: the probe and 64k (fits an H100, about 4.5 minutes); long: the two long probes (an H200's memory; the 8B's
#   with what is live at its peak by origin, e2e.py --snapshot, in e2e_long.snapshot.jsonl); all: both;
#   mid: the 8B (2 layers) at 384k on the device and offloaded, each with its snapshot (fits an H100, about 4 minutes)
set -u
out=${1:?OUTDIR}
part=${2:-all}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
e2e() { python3 benchmarks/e2e.py --methods tilecompile --checkpointing on --csv "$out/e2e_long.csv" "$@" 2>&1 | grep -v "^W1\|Warning\|^E1" | grep "ok=\|cut\|^snapshot"; }
if [ "$part" = mid ]; then
e2e --models 8b --layers 2 --lengths 393216 --probe --env TILECOMPILE_OFFLOAD=all --budget 150 --snapshot
e2e --models 8b --layers 2 --lengths 393216 --probe --env TILECOMPILE_MEMORY_BUDGET=0 --budget 150 --snapshot
exit 0
fi
if [ "$part" != long ]; then
timeout 150 python3 benchmarks/probe_offload.py --tokens 16384 --repeats 2 --variants regions,flat,offload,offload_flat \
  2>&1 | grep "^{" | tee "$out/probe_offload.jsonl"
e2e --models 8b --layers 8 --lengths 65536 --repeats 2 --env TILECOMPILE_MEMORY_BUDGET=0 --budget 60
e2e --models 8b --layers 8 --lengths 65536 --repeats 2 --env TILECOMPILE_OFFLOAD=all --budget 60
fi
if [ "$part" != short ]; then
e2e --models 8b --layers 2 --lengths 524288 --probe --env TILECOMPILE_OFFLOAD=all --budget 170 --snapshot
e2e --models 1.5b --layers 2 --lengths 1048576 --probe --env TILECOMPILE_OFFLOAD=all --budget 150
fi
