#!/usr/bin/env bash
# One device-tool call: build, GPU tests, sanitizer, training runs and the exchange benchmark.
# Usage there: bash benchmarks/device_run.sh [steps...]; logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
nvidia-smi -L
./build.sh > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
steps=${*:-tests sanitize train bench}
for step in $steps; do
  echo "=== $step"
  case $step in
    tests) timeout 540 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_exchange.py tests/test_gpu_runtime.py 2>&1 | tail -15 ;;
    xla) grep -i "without the XLA" "$OUT/build.log"; timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py -k "xla or jax" 2>&1 | tail -15 ;;
    runtime) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py 2>&1 | tail -15 ;;
    # Where a step's time goes: host or GPU, one rank or two per GPU, with the exchange or not.
    diag)
      nvidia-smi topo -m; nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
      IFS=';' read -ra runs <<< "${DIAG:---gpus 0 --no-exchanger;--gpus 0 0 --no-exchanger;--gpus 0 1 --no-exchanger;--gpus 0 1;--gpus 1 0}"
      for run in "${runs[@]}"; do
        echo "--- probe_xla $run"
        case $run in *NO_P2P) env PYMPGU_NO_P2P=1 timeout 150 python3 benchmarks/probe_xla.py ${run% NO_P2P} ;;
                     *) timeout 150 python3 benchmarks/probe_xla.py $run ;; esac 2>&1 | grep -v -i warn | tail -6
      done ;;
    probe) timeout 120 python3 benchmarks/probe_dlpack.py 2>&1 | grep -v -i warn | tail -14 ;;
    # When each point of the XLA exchange happens (CUDA events), with the barrier before the
    # copies on either stream. TIMELINE="--gpus 0 1 --hidden 4096 4096" by default.
    timeline) timeout 300 python3 benchmarks/probe_timeline.py ${TIMELINE:---gpus 0 1} 2>&1 | grep -v -i warn | tail -40 ;;
    resident) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_exchange.py -k "${RESIDENT_K:-resident}" 2>&1 | tail -15 ;;
    # The host's pieces of one small exchange, launched and resident (QUEUE="--blocks 1 8").
    queue) timeout 150 python3 benchmarks/probe_queue.py ${QUEUE:-} 2>&1 | grep -v -i warn | tail -16 ;;
    # What NVLink carries per traffic pattern, one process driving both GPUs (LINK="1024").
    link) nvcc -O3 -std=c++17 -arch=sm_90 -DPMG_WITH_CUDA -Icsrc benchmarks/link_probe.cu csrc/host_average.cpp -o /tmp/link_probe \
            && timeout 240 /tmp/link_probe ${LINK:-1024} ;;
    # The stream barriers: the watchdog's test alone (it hung before its release needed no
    # CUDA call), then the rest of the runtime's GPU tests (one device call); then the
    # benchmark with PYMPGU_STREAM_BARRIER 1 and 0 alternating in four rounds (another), its
    # rows in $OUT.
    stream)
      timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py -k late_peer 2>&1 | tail -5
      timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py -k "not late_peer" 2>&1 | tail -8 ;;
    streambench)
      timeout 400 python3 -m pympgu.bench train --gpus 0 1 --models wide --variants overlap4 --no-ddp --repeats 4 \
        --env PYMPGU_STREAM_BARRIER=1,0 --json "$OUT/streambench.json" 2>&1 | grep "runs,\|scaling" ;;
    # What a stream memory operation's wait holds on the host, and barriers timed three ways.
    streamwait) nvcc -O3 -std=c++17 -arch=sm_90 -DPMG_WITH_CUDA -Icsrc benchmarks/probe_stream_wait.cu csrc/host_average.cpp \
                  -o /tmp/probe_stream_wait && timeout 120 /tmp/probe_stream_wait ;;
    # DMA copies between two processes through IPC (DMA="--offsets 0:0 18688:18688").
    dma) timeout 150 python3 benchmarks/probe_dma.py ${DMA:-} 2>&1 | tail -30 ;;
    nccl) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_exchange.py -k nccl 2>&1 | tail -3 ;;
    sanitize)
      for tool in memcheck racecheck; do
        PYMPGU_TEST_MAX_N=70000 timeout ${SANITIZE_S:-200} compute-sanitizer --tool $tool --target-processes all \
          python3 -m pytest -q -p no:cacheprovider tests/test_gpu_exchange.py -k "${SANITIZE_K:-all_methods and 2-None or wire_kernels}" 2>&1 | tail -3
      done ;;
    train)
      d=${DATA:-.data/fashion}
      timeout 300 python3 -m pympgu.train --gpus 0 --data-dir $d --preset dual_mlp --quiet --out $OUT/seed1 2>&1 | grep -v -i warn | tail -13
      timeout 300 python3 -c "from pympgu import train; import sys; a = train.build_parser().parse_args(['--cpu','2','--data-dir','$d','--preset','dual_mlp']); cfg,_,_ = train.resolve(a, train.build_parser()); cfg.update(backend='jax', out='$OUT/seed2'); train.run(cfg, [0, 0], quiet=True)" 2>&1 | grep -v -i warn | tail -13
      timeout 300 python3 -m pympgu.train --gpus 0 --data-dir $d --hidden 4096 4096 --batch-size 1024 --epochs 3 --quiet 2>&1 | grep -v -i warn | tail -5 ;;
    train2)  # the 2-GPU kind: the seed preset and the wide MLP on --gpus 0 1
      d=${DATA:-.data/fashion}
      timeout 200 python3 -m pympgu.train --gpus 0 1 --data-dir $d --preset dual_mlp --quiet 2>&1 | grep -v -i warn | tail -12
      timeout 200 python3 -m pympgu.train --gpus 0 1 --data-dir $d --hidden 4096 4096 --batch-size 1024 --epochs 3 --quiet 2>&1 | grep -v -i warn | tail -5 ;;
    # 1-GPU rows (pympgu, plain JAX, DDP); then the multi-rank variants with 2 ranks on GPU 0
    # (logic only: they time-slice). TRAINBENCH="--gpus 0 1" on the 2-GPU kind; several runs
    # separated by semicolons.
    trainbench)
      IFS=';' read -ra runs <<< "${TRAINBENCH:---gpus 0}"
      for k in "${!runs[@]}"; do
        echo "--- bench train ${runs[$k]}"
        timeout 400 python3 -m pympgu.bench train ${runs[$k]} --json "$OUT/train_bench$k.json" 2>&1 | grep -v -i "warn\|return func\|return lax" | tail -26
      done
      [ -z "${TRAINBENCH:-}" ] && timeout 150 python3 -m pympgu.bench train --gpus 0 0 --models wide --steps 10 --warmup 3 --no-ddp 2>&1 | grep -v -i warn | tail -8 ;;
    variants) timeout 540 python3 benchmarks/accuracy_variants.py --data-dir ${DATA:-.data/fashion} --gpus ${VGPUS:-0 0} 2>&1 | grep -v -i warn | tail -10 ;;
    conv) timeout 200 python3 benchmarks/probe_conv.py 2>&1 | tail -8 ;;
    # The convnet (examples/lenet.py): its GPU tests; its step against DDP's and PyTorch's
    # (LENET="--gpus 0 1" on the 2-GPU kind, LENET_BATCH=128 for the small batch); each
    # exchange variant's test error (VGPUS="0 1" there). Not yet run as one step: its parts
    # took 1 to 3 minutes each on one GPU (docs/BENCHMARKS.md, session 30).
    lenet)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_nnet.py tests/test_gpu_runtime.py -k "agrees or convnet" 2>&1 | tail -3
      timeout 360 python3 -m pympgu.bench train ${LENET:---gpus 0} --model examples/lenet.py:LeNet --hidden 500 --repeats 2 \
        --batch-size ${LENET_BATCH:-1024} --variants sync1 overlap sync4 overlap4 --json "$OUT/lenet_bench.json" 2>&1 \
        | grep -v -i "warn\|return lax" | tail -16
      timeout 60 python3 benchmarks/probe_lenet.py --batch ${LENET_BATCH:-1024} 2>&1 | tail -6
      timeout 400 python3 benchmarks/accuracy_variants.py --data-dir ${DATA:-.data/fashion} --gpus ${VGPUS:-0 0} --epochs 10 \
        --model examples/lenet.py:LeNet --hidden 500 --variants overlap "sync every 4" "overlap + sync every 4" 2>&1 | tail -5 ;;
    # The convnets' scaling against DDP's, on the GPUs of CONVNETS (default "--gpus 0 1":
    # the 2-GPU kind), the variants whose speed the issue asks about. Up to 4.5 minutes a
    # model: CONVNET_MODELS=examples/lenet.py:LeNet runs one, to fit a 10-minute call.
    convnets)
      for model in ${CONVNET_MODELS:-examples/lenet.py:LeNet examples/strided.py:StridedConvNet}; do
        echo "--- $model"
        timeout 270 python3 -m pympgu.bench train ${CONVNETS:---gpus 0 1} --model $model --repeats 2 \
          --variants sync1 sync4 overlap4 --json "$OUT/$(basename ${model%%.py*})_bench.json" 2>&1 \
          | grep -v -i "warn\|return lax\|delay kernel" | tail -14
      done ;;
    # Adam on 2 GPUs: its GPU test, and its scaling against DDP's Adam (session 29's Next).
    adam2)
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py -k adam 2>&1 | tail -3
      timeout 400 python3 -m pympgu.bench train --gpus 0 1 --models wide --variants sync1 sync4 overlap4 \
        --optimizer adam --repeats 2 --json "$OUT/adam2.json" 2>&1 | grep -v -i "warn\|delay kernel" | tail -14 ;;
    # The gradients in bfloat16 inside the step against float32's and DDP's with
    # bf16_compress_hook, on the 2-GPU kind (session 35's Next).
    bf16grad)
      timeout 500 python3 -m pympgu.bench train --gpus 0 1 --models wide --variants sync1 sync1-bf16 \
        --no-ddp-graph --repeats 3 --json "$OUT/bf16grad.json" 2>&1 | grep -v -i "warn\|delay kernel" | tail -16 ;;
    # --clip-norm on the 2-GPU kind: its GPU tests, then the exact step clipped (the norm of
    # the mean gradients, the step compiled alike on both ranks) against DDP with
    # clip_grad_norm_, in rounds, and the same unclipped.
    clip)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_gpu_runtime.py -k clipped 2>&1 | tail -3
      for c in 1 0; do
        timeout 220 python3 -m pympgu.bench train --gpus 0 1 --models wide --variants sync1 --no-ddp-graph \
          --repeats 2 --clip-norm $c --json "$OUT/clip$c.json" 2>&1 | grep -v -i "warn\|delay kernel" | tail -9
      done ;;
    # --ema on 2 GPUs: its GPU tests, its step against the plain one and DDP's with a lerp,
    # and its Fashion-MNIST errors against plain averaging.
    ema)
      timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_gpu_runtime.py -k training_ema 2>&1 | tail -3
      for e in 0.999 0; do
        timeout 220 python3 -m pympgu.bench train --gpus 0 1 --models wide --variants sync1 --no-ddp-graph \
          --repeats 2 --ema $e --json "$OUT/ema$e.json" 2>&1 | grep -v -i "warn\|delay kernel" | tail -9
      done
      timeout 200 python3 benchmarks/accuracy_variants.py --data-dir ${DATA:-.data/fashion} --gpus 0 1 --epochs 10 \
        --variants "ema 0.99" 2>&1 | tail -3 ;;
    # PyTorch with pympgu.ddp: its GPU tests (DDP's hook, ModelAverager, CUDA graphs), DDP's
    # step with the hook, eager and in a graph, against DDP's own NCCL all-reduce on the
    # 2-GPU kind (DDPHOOK="--gpus 0 1"), and a
    # model's replicas averaged by torch.distributed and by ModelAverager (TORCHAVG).
    ddphook)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_gpu_ddp.py tests/test_gpu_graphs.py 2>&1 | tail -3
      timeout 300 python3 benchmarks/torch_average.py ${TORCHAVG:---gpus 0 1 --models seed wide deep} 2>&1 \
        | grep -v -i warn | tail -9
      timeout 400 python3 -m pympgu.bench train ${DDPHOOK:---gpus 0 1} --models seed wide --variants sync1 \
        --ddp-pympgu --repeats 2 --json "$OUT/ddphook.json" 2>&1 | grep -v -i "warn\|delay kernel" | tail -16 ;;
    # BENCH="--gpus 0 1" on the 2-GPU kind; the default puts 2 ranks on one GPU.
    bench) timeout 500 python3 -m pympgu.bench ${BENCH:---gpus 0 --procs 2 --sizes 4K 64K 1M 64M} --json "$OUT/bench.json" 2>&1 | tail -25 ;;
    # The installed package, away from the source tree: it must train on its embedded data.
    pip) timeout 300 python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/pipcheck . && (cd /tmp && PYTHONPATH=/tmp/pipcheck:/tmp/site python3 -m pympgu \
           && PYTHONPATH=/tmp/pipcheck:/tmp/site timeout 200 python3 -m pympgu.train --gpus 0 --epochs 1 --quiet 2>&1 | grep -v -i warn | tail -3) ;;
  esac
done
