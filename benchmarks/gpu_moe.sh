#!/bin/bash
# Issue 42, one device call: the Qwen3-30B-A3B step (4 of 48 layers, checkpointing on) with the experts left alone
# against tiled, no memory plan for either, Inductor's step at 32k in the same call, then the op alone.
# usage (on the device, repo root): bash benchmarks/gpu_moe.sh OUTDIR [all|step|op|memory|profile|default|accept|chunks|tma]
#   step: the three step runs (about 4 minutes on an H100); op: bench_moe_op.py alone with its kernel profile (about
#   1.5 minutes); memory: checkpointing off at 16k (tiled, left alone, Inductor) and Inductor at 8k (about 4 minutes);
#   all: step and op; profile: the rows check (forward and the weighted backward), the step left alone and tiled at 8k
#   and 32k with the tiled step's 14 costliest kernels, and the op at the budget's chunk (about 7 minutes on an H100);
#   default: the rows check, the default step against the experts left alone at 8k and 32k (about 3.5 minutes);
#   accept: issue 42's step rows in one call: default, default with 1 GiB chunks, left alone (again at 32k, last),
#   Inductor at 8k, 32k and (on a card with more than 100 GiB) 64k (about 6 minutes on an H100);
#   chunks: at 32k, the experts' chunk budget at 512 and 768 MiB between two left-alone runs, then the op alone at the
#   matching chunk rows (about 5 minutes); tma: grouped_wgrad's tensor-descriptor loads against its pointer loads,
#   the op alone and the step at 32k (about 6 minutes)
set -u
out=${1:?OUTDIR}
part=${2:-all}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
e2e() { python3 benchmarks/e2e.py --models 30b-a3b --layers 4 --checkpointing on --repeats 2 --csv "$out/e2e_moe.csv" "$@" 2>&1 | grep -v "^W1\|Warning" | grep "ok=\|cut\|skipped\|E2E_SET"; }
if [ "$part" = memory ]; then
e2e --methods tilecompile --lengths 16384 --checkpointing off --env TILECOMPILE_MEMORY_BUDGET=0 --note "experts tiled by default, no checkpointing" --budget 100
e2e --methods tilecompile --lengths 16384 --checkpointing off --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_EXPERTS=0 --note "experts left alone, no checkpointing" --budget 100
e2e --methods inductor --lengths 16384 --checkpointing off --budget 100
e2e --methods inductor --lengths 8192 --budget 100
exit 0
fi
if [ "$part" = default ]; then  # the rows check, then the default step (experts tiled by check_pays) against them left alone
timeout 90 python3 benchmarks/check_moe_rows.py 2>&1 | grep "check"
e2e --methods tilecompile --lengths 8192,32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_EXPERTS=0 --note "experts left alone" --budget 150
e2e --methods tilecompile --lengths 8192,32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0 --note "default (check_pays tiles from about 6.2k tokens a layer)" --budget 150
exit 0
fi
if [ "$part" = accept ]; then
timeout 90 python3 benchmarks/check_moe_rows.py 2>&1 | grep "check"
e2e --methods tilecompile --lengths 8192,32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_EXPERTS=0 --note "experts left alone" --budget 120
e2e --methods tilecompile --lengths 8192,32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0 --note "default (check_pays tiles from about 6.2k tokens a layer)" --budget 120
e2e --methods tilecompile --lengths 32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_CHUNK_BUDGET_MB=1024 --note "default, chunks of 1 GiB" --budget 80
e2e --methods tilecompile --lengths 32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_EXPERTS=0 --note "experts left alone, after" --budget 80
big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$big" -gt 100000 ]; then lens=8192,32768,65536; else lens=8192,32768; fi
e2e --methods inductor --lengths $lens --budget 200
exit 0
fi
if [ "$part" = tma ]; then  # grouped_wgrad through tensor descriptors against pointer loads: the op alone, the sweep,
# then the step at 32k left alone, default and default with descriptor loads (about 6 minutes on an H100)
timeout 240 python3 benchmarks/bench_moe_op.py --repeats 5 --memory-tokens "" --no-loop --chunks 0,43648,262144 --wgrad-sweep --csv "$out/moe_op.csv" 2>&1 | grep -v "^W1\|Warning" | tail -50
e2e --methods tilecompile --lengths 32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_EXPERTS=0 --note "experts left alone" --budget 70
e2e --methods tilecompile --lengths 32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0,E2E_SET=tilecompile.kernels.tiled_grouped_mlp.USE_TMA=False --note "default, grouped_wgrad pointer loads" --budget 70
e2e --methods tilecompile --lengths 32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0,E2E_SET=tilecompile.kernels.tiled_grouped_mlp.USE_TMA=True --note "default, grouped_wgrad tensor-descriptor loads" --budget 70
exit 0
fi
if [ "$part" = chunks ]; then
e2e --methods tilecompile --lengths 32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_EXPERTS=0 --note "experts left alone" --budget 70
for mb in 512 768; do
e2e --methods tilecompile --lengths 32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_CHUNK_BUDGET_MB=$mb --note "default, chunks of $mb MiB" --budget 70
done
e2e --methods tilecompile --lengths 32768 --repeats 3 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_EXPERTS=0 --note "experts left alone, after" --budget 70
timeout 100 python3 benchmarks/bench_moe_op.py --repeats 5 --memory-tokens "" --no-loop --chunks 0,87296,131072,262144 --csv "$out/moe_op.csv" 2>&1 | grep -v "^W1\|Warning" | tail -12
exit 0
fi
if [ "$part" = profile ]; then
timeout 90 python3 benchmarks/check_moe_rows.py 2>&1 | grep "check"
e2e --methods tilecompile --lengths 8192,32768 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_EXPERTS=0 --note "experts left alone" --budget 150
python3 benchmarks/e2e.py --models 30b-a3b --layers 4 --checkpointing on --repeats 2 --csv "$out/e2e_moe.csv" --methods tilecompile \
  --lengths 8192,32768 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_MIN_TOKENS=0 --note "experts tiled" --budget 150 --profile 14 \
  2>&1 | grep -v "^W1\|Warning\|^E1" | grep "ok=\|cut\|skipped\|^--\|^ "
timeout 120 python3 benchmarks/bench_moe_op.py --repeats 5 --memory-tokens "" --no-loop --chunks 0 --csv "$out/moe_op.csv" 2>&1 | grep -v "^W1\|Warning" | tail -20
exit 0
fi
if [ "$part" != op ]; then
e2e --methods tilecompile --lengths 8192,32768 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_EXPERTS=0 --note "experts left alone" --budget 150
e2e --methods tilecompile --lengths 8192,32768 --env TILECOMPILE_MEMORY_BUDGET=0,TILECOMPILE_MLP_MIN_TOKENS=0 --note "experts tiled" --budget 150
e2e --methods inductor --lengths 32768 --budget 150
fi
if [ "$part" != step ]; then
timeout 60 python3 benchmarks/check_moe_rows.py 2>&1 | grep "rows_out"
timeout 200 python3 benchmarks/bench_moe_op.py --repeats 5 --memory-tokens "" --no-loop --chunks 0,65536,262144 --profile --wgrad-sweep --csv "$out/moe_op.csv" 2>&1 | grep -v "^W1\|Warning" | tail -60
fi
