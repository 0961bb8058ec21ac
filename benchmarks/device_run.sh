#!/usr/bin/env bash
# On a GPU machine: build, then the named steps; logs and JSON go to $OUT.
# Usage: bash benchmarks/device_run.sh [tests|sanitize|train|trainbench|bench|ddp|pip|nodes|cpu|probe|kills ...]
# Wheels for packages the machine lacks (pyzmq, pytensor) are read from .whl/.
# On one GPU, ranks share it: results check the logic, not NVLink's speed.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi -L
./build.sh > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
NGPU=$(nvidia-smi -L | wc -l)
GPUS=${GPUS:-$(seq -s ' ' 0 $((NGPU - 1)))}
# Where there is one GPU, the multi-rank steps put two ranks on it.
if [ "$NGPU" -gt 1 ]; then RANKS="--gpus $GPUS"; SHARED=$GPUS; else RANKS="--gpus 0 --procs 2"; SHARED="0 0"; fi
DATA=${DATA:-.data/fashion}
quiet() { grep -v -i "warn\|return lax\|return func\|delay kernel"; }
for step in ${*:-tests train bench}; do
  echo "=== $step (GPUs: $GPUS)"
  case $step in
    # Every test that needs a GPU, spread over the cores; K narrows it (pytest -k).
    tests) timeout ${TESTS_S:-560} python3 -m pytest -q -p no:cacheprovider -n ${JOBS:-15} ${K:+-k "$K"} \
             tests/test_gpu_runtime.py tests/test_gpu_exchange.py tests/test_gpu_ddp.py \
             tests/test_gpu_graphs.py tests/test_nnet.py tests/test_gpu_nodes.py > "$OUT/tests.log" 2>&1
           tail -15 "$OUT/tests.log" ;;
    sanitize)
      for tool in memcheck racecheck; do
        PYMPGU_TEST_MAX_N=70000 timeout ${SANITIZE_S:-200} compute-sanitizer --tool $tool --target-processes all \
          python3 -m pytest -q -p no:cacheprovider tests/test_gpu_exchange.py -k "${K:-all_methods and 2-None or wire_kernels}" 2>&1 | tail -3
      done ;;
    train)
      timeout 300 python3 -m pympgu.train --gpus $GPUS --data-dir $DATA --preset dual_mlp --quiet --out "$OUT/dual" 2>&1 | quiet | tail -13
      timeout 300 python3 -m pympgu.train --gpus $GPUS --data-dir $DATA --hidden 4096 4096 --batch-size 1024 --epochs 3 --quiet 2>&1 | quiet | tail -5 ;;
    # Step times of pympgu's variants, plain JAX and DDP (TRAINBENCH adds flags).
    trainbench) timeout 500 python3 -m pympgu.bench train --gpus $GPUS ${TRAINBENCH:-} --json "$OUT/train_bench.json" 2>&1 | quiet | tail -26 ;;
    # The exchange alone against NCCL, per message size.
    bench) timeout 500 python3 -m pympgu.bench exchange $RANKS ${BENCH:---sizes 4K 64K 1M 64M} --json "$OUT/bench.json" 2>&1 | tail -25 ;;
    # PyTorch: DDP's hook and ModelAverager against torch.distributed.
    ddp) timeout 300 python3 benchmarks/torch_average.py --gpus $SHARED --models seed wide deep 2>&1 | quiet | tail -9 ;;
    # The installed package, away from the source tree, on its embedded data.
    pip) timeout 300 python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/pipcheck . && (cd /tmp \
           && PYTHONPATH=/tmp/pipcheck:${PYTHONPATH:-} timeout 200 python3 -m pympgu.train --gpus $GPUS --epochs 1 --quiet 2>&1 | quiet | tail -3) ;;
    # Across "nodes" of this host (NCCL_HOSTID apart): the tests, then the hierarchy
    # against flat NCCL (loopback sockets between the nodes: overhead, not a network).
    nodes) python3 -m pympgu | grep NCCL
      timeout ${TESTS_S:-400} python3 -m pytest -q -p no:cacheprovider -n ${JOBS:-4} tests/test_gpu_nodes.py \
        tests/test_gpu_ddp.py -k "${K:-nodes or across_hosts}" > "$OUT/nodes_tests.log" 2>&1
      tail -15 "$OUT/nodes_tests.log"
      timeout 300 python3 -m pympgu.bench --nnodes 2 --gpus 0 ${BENCH:---sizes 4K 64K 1M 64M 256M} \
        --json "$OUT/bench_nodes.json" 2>&1 | tail -20 ;;
    # CPU workers on this host's cores: the exchange's share of the step, unpinned and
    # pinned (pympgu.runtime.cores), and the bench against DDP on gloo (pinned alike), at 2
    # and 4 workers; then 2 nodes x 2 workers on loopback, each node on half the cores.
    cpu) for n in 2 4; do
           for pin in 0 1; do echo "$n workers, PYMPGU_PIN_CPU_WORKERS=$pin"
             PYMPGU_PIN_CPU_WORKERS=$pin timeout 200 python3 -m pympgu.train --cpu $n --epochs 4 \
               2>&1 | quiet | grep -E "^epoch   4|^done"
           done
           timeout 250 python3 -m pympgu.bench train --cpu $n --models seed --batch-size 128 \
             --variants sync1 --steps 300 --repeats 3 2>&1 | quiet | tail -8
         done
         export PYMPGU_SECRET=$(python3 -c "import secrets; print(secrets.token_hex(32))")
         half=$(( $(nproc) / 2 ))
         for k in 1 0; do taskset -c $(( k * half ))-$(( k * half + half - 1 )) timeout 200 \
           python3 -m pympgu.train --cpu 2 --epochs 4 --nnodes 2 --node-rank $k \
           --coordinator 127.0.0.1:29611 > "$OUT/node$k.log" 2>&1 & done; wait
         grep -E "^epoch|^done" "$OUT/node0.log" ;;
    # One GPU, no exchange: the loop's step against plain JAX.
    probe) timeout 300 python3 benchmarks/probe_step.py --gpus 0 2>&1 | quiet | tail -14
           timeout 300 python3 -m pympgu.bench train --gpus 0 --models wide --no-ddp --repeats 3 2>&1 | quiet | tail -8 ;;
    # Random kills of GPU workers: 2 nodes x 2 workers sharing GPU 0, DiLoCo between them,
    # each kill's node starting its workers again (KILLS: the runs, kills and epochs).
    kills) PYTHONPATH=$PWD:${PYTHONPATH:-} timeout ${KILLS_S:-560} python3 -m pympgu.bench kills \
             --nnodes 2 --command "python3 benchmarks/two_on_one_gpu.py --gpus 0" --min-workers 2 \
             --restart-workers 50 ${KILLS:---runs 3 --kills 5 --epochs 30} --data-dir $DATA \
             --train-flags "--across-nodes diloco --outer-every 10" --json "$OUT/kills.json" 2>&1 \
             | quiet | tail -14 ;;
    *) echo "unknown step: $step"; exit 2 ;;
  esac
done
