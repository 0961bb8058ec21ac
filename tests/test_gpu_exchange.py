"""GPU tests: replicas averaged across processes through IPC, checked bit for bit.

Run through the device tool. With fewer GPUs than ranks, ranks share GPUs round-robin
(CUDA IPC works between processes on one device), which checks every R-way code path.
"""
import os
import tempfile

import numpy as np
import pytest

import pympgu
from conftest import visible_gpus
from gpu_workers import (case_inputs, exchange_cases, ll_rounds, nccl_average, resident_rounds,
                         resident_silent_peer, run_children)
from reference import mean64, model_average, same_bits, to_f32

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

DTYPES = ["float32", "float16", "bfloat16"]
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# PYMPGU_TEST_MAX_N trims the sizes, for runs under compute-sanitizer.
SIZES = [n for n in [1, 7, 8, 9, 1000, 4097, 65537, (1 << 20) + 3, (8 << 20) + 5]
         if n <= int(os.environ.get("PYMPGU_TEST_MAX_N", 1 << 40))]


def check_results(results, cases, nranks):
    for c, (seed, n, dtype, method, integers) in enumerate(cases):
        inputs = [case_inputs(seed, r, nranks, n, dtype, integers) for r in range(nranks)]
        expected = model_average(inputs, dtype)
        what = f"case n={n} {dtype} {method} R={nranks}"
        first = results[0][c][0]
        for rank in range(nranks):
            raw, guard_ok = results[rank][c]
            assert guard_ok, f"{what}: rank {rank} wrote past the end of the buffer"
            assert raw == first, f"{what}: rank {rank} differs from rank 0"
        got = np.frombuffer(first, dtype=expected.dtype)
        assert same_bits(got, expected, dtype), f"{what}: not the exact fp32 rank-order mean"
        err = np.abs(to_f32(got, dtype) - mean64(inputs, dtype))
        assert np.all(err <= np.abs(mean64(inputs, dtype)) * 2 ** -7 + 1e-6), what


@pytest.mark.parametrize("nranks,max_blocks", [(2, None), (3, None), (4, None), (8, None),
                                               (2, 3), (3, 3), (4, 3)])
def test_peer_group_all_methods(nranks, max_blocks, pympgu_env, seed):
    sizes = SIZES if max_blocks is None else SIZES[:-1]
    if max_blocks is not None:
        # Many small copy-engine chunks, some of them empty on the last rank's short slice
        # (the children inherit the environment).
        pympgu_env(ce_chunk_bytes=64 * 1024 + 48)
    cases = [(seed + i, n, dtype, method, False)
             for i, (n, dtype, method) in enumerate(
                 (n, d, m) for n in sizes for d in DTYPES
                 for m in ("ll", "oneshot", "twoshot", "push", "ce", "copy")
                 if m != "ll" or n * ITEMSIZE[d] <= pympgu.cuda.LL_MAX_BYTES)]
    capacity = max(n for n in sizes) * 4
    results = run_children(exchange_cases, nranks,
                           (nranks, visible_gpus(), cases, max_blocks, capacity))
    check_results(results, cases, nranks)


@pytest.mark.parametrize("nranks", [2, 3])
def test_peer_group_offset(nranks, seed):
    """allreduce(offset=): the elements from that byte on are averaged, exact, by every
    algorithm, and nothing before or after them is touched (pympgu.ddp's buckets each keep
    their place in the buffer)."""
    sizes = [n for n in (7, 4097, (1 << 20) + 3) if n <= max(SIZES)]  # PYMPGU_TEST_MAX_N
    cases = [(seed + i, n, dtype, method, False)
             for i, (n, dtype, method) in enumerate(
                 (n, d, m) for n in sizes for d in DTYPES
                 for m in ("ll", "oneshot", "twoshot", "push", "ce")
                 if m != "ll" or n * ITEMSIZE[d] <= pympgu.cuda.LL_MAX_BYTES)]
    offset = 4096 + 48  # off the page, on the kernels' 16 bytes
    results = run_children(exchange_cases, nranks, (nranks, visible_gpus(), cases, None,
                                                     max(sizes) * 4, offset))
    check_results(results, cases, nranks)


def test_peer_group_offset_is_checked(seed):
    group = pympgu.cuda.PeerGroup(0, 1, 4096, device=0)
    try:
        group.connect([group.handle])
        with pytest.raises(ValueError, match="multiple of 16"):
            group.allreduce(4, "float32", offset=8)
        with pytest.raises(ValueError, match="from byte 4080 do not fit"):
            group.allreduce(5, "float32", offset=4080)
        group.allreduce(4, "float32", offset=4080)  # the last 16 bytes
    finally:
        group.close()


def ll_plan(rounds, seed):
    """[(seed, n, dtype)] for rounds of 'll': every dtype in turn, sizes from one element to
    the most its mailboxes take, so that the grid changes from round to round."""
    rng = np.random.default_rng(seed)
    plan = []
    for i in range(rounds):
        dtype = DTYPES[i % 3]
        most = pympgu.cuda.LL_MAX_BYTES // ITEMSIZE[dtype]
        n = [1, most, int(rng.integers(1, 600)), int(rng.integers(1, most + 1))][i % 4]
        plan.append((seed + i, n, dtype))
    return plan


@pytest.mark.parametrize("nranks", [2, 3, 8])
def test_ll_rounds_back_to_back(nranks, seed):
    """'ll' keeps one round's mailboxes clear of the next's with no barrier between rounds,
    over sizes that change the grid from round to round (a line may change blocks), up to
    the largest it takes, in every dtype: every round exact on every rank."""
    plan = ll_plan(40, seed)
    results = run_children(ll_rounds, nranks, (nranks, visible_gpus(), plan))
    check_results(results, [(s, n, d, "ll", False) for s, n, d in plan], nranks)


def test_ll_on_one_rank_and_its_limit(seed):
    top = pympgu.cuda.LL_MAX_BYTES
    group = pympgu.cuda.PeerGroup(0, 1, 2 * top, device=0)
    try:
        group.connect([group.handle])
        x = np.random.default_rng(seed).standard_normal(top // 4).astype(np.float32)
        group.data("float32", x.size).copy_from_host(x)
        assert group.allreduce(x.size, "float32", algo="ll") == "ll"
        assert np.array_equal(group.data("float32", x.size).copy_to_host(), x)
        auto = pympgu.cuda.ll_max_bytes() // 4
        assert group.allreduce(auto, "float32") == "ll"
        assert group.allreduce(auto + 1, "float32") != "ll"
        with pytest.raises(ValueError, match="at most"):
            group.allreduce(x.size + 1, "float32", algo="ll")
    finally:
        group.close()


@pytest.mark.parametrize("nranks,blocks", [(2, None), (3, 2), (8, 1)])
def test_resident_exchange(nranks, blocks, seed):
    """The resident kernel, over rounds that change size and dtype with no barrier between
    them: every round exact on every rank, as 'll' launched; the group refuses its other
    work meanwhile, memory freed meanwhile waits for the kernel's end; launched exchanges
    work after it."""
    plan = ll_plan(24, seed)
    results = run_children(resident_rounds, nranks, (nranks, visible_gpus(), plan, blocks))
    methods = ["resident"] * (len(plan) - 2) + ["ll", "oneshot"]
    check_results([r[0] for r in results],
                  [(s, n, d, m, False) for (s, n, d), m in zip(plan, methods)], nranks)
    for rank, (_, refused, deferred, deferred_after) in enumerate(results):
        assert refused == ["allreduce", "barrier", "resident", "synchronize"], rank
        assert (deferred, deferred_after) == (1, 0), rank


def test_resident_peer_that_never_rings():
    """A rank whose peer never rings gets CUDA's error within the group's timeout, with
    the rank and the reason in the message, instead of hanging; while that call waits,
    another thread's call and close are refused rather than overwrite its command."""
    results = run_children(resident_silent_peer, 2, (visible_gpus(), 2.0))
    (name, message, seconds), refused = results[0]
    assert name == "cudaErrorLaunchFailure", message
    assert "rank 0 of 2, resident exchange 1" in message and "traps after 2 s" in message
    assert 1.5 < seconds < 30, seconds
    assert refused == ["allreduce", "close"]


def test_resident_on_one_rank_and_its_limits(seed):
    top = pympgu.cuda.LL_MAX_BYTES
    group = pympgu.cuda.PeerGroup(0, 1, 2 * top, device=0)
    try:
        group.connect([group.handle])
        with pytest.raises(ValueError, match="SMs"):
            group.resident(blocks=group.sm_count + 1)
        x = np.random.default_rng(seed).standard_normal(top // 4).astype(np.float32)
        group.data("float32", x.size).copy_from_host(x)
        with group.resident(blocks=1) as fast:
            for _ in range(1000):
                fast.allreduce(x.size)
                fast.allreduce(7, "bfloat16")
            with pytest.raises(ValueError, match="at most"):
                fast.allreduce(x.size + 1)
            assert np.array_equal(group.data("float32", x.size).copy_to_host(), x)
        assert not fast.running
        with pytest.raises(RuntimeError, match="closed"):
            fast.allreduce(1)
        fast.close()  # again: nothing
        assert group.allreduce(x.size, "float32", algo="ll") == "ll"
        pympgu.cuda.synchronize()  # allowed again
    finally:
        group.close()


@pytest.mark.multi_gpu(2)
def test_matches_nccl_on_integer_inputs(seed):
    torch = pytest.importorskip("torch")
    assert torch.cuda.device_count() >= 2
    n = (4 << 20) + 3
    with tempfile.TemporaryDirectory() as tmp:
        nccl = run_children(nccl_average, 2, (2, seed, n, os.path.join(tmp, "init")))
    cases = [(seed, n, "float32", m, True)
             for m in ("oneshot", "twoshot", "push", "ce", "copy")]
    ours = run_children(exchange_cases, 2, (2, 2, cases, None, n * 4))
    assert nccl[0] == nccl[1]
    for c in range(len(cases)):
        assert ours[0][c][0] == nccl[0], f"{cases[c][3]} differs from NCCL AVG"


def test_direct_average_on_framework_arrays():
    torch = pytest.importorskip("torch")
    devs = list(range(min(visible_gpus(), 2)))
    if len(devs) == 2 and pympgu.cuda.can_access_peer(0, 1):
        pympgu.cuda.set_device(0)
        pympgu.cuda.enable_peer_access(1)
        pympgu.cuda.enable_peer_access(1)  # idempotent
    else:
        devs = [0, 0]
    for dtype, tdtype in [("float32", torch.float32), ("float16", torch.float16),
                          ("bfloat16", torch.bfloat16)]:
        n = 100_003
        xs = [torch.randn(n, dtype=tdtype, device=f"cuda:{d}") for d in devs]
        out = torch.full((n,), float("nan"), dtype=tdtype, device="cuda:0")
        pympgu.average(xs, out)  # bf16 goes through DLPack, the others through CAI
        host = [x.view(torch.int16).cpu().numpy().view(np.uint16) if dtype == "bfloat16"
                else x.cpu().numpy() for x in xs]
        got = (out.view(torch.int16).cpu().numpy().view(np.uint16) if dtype == "bfloat16"
               else out.cpu().numpy())
        assert same_bits(got, model_average(host, dtype), dtype), dtype
    # Many tensors in one launch, in place into replica 0.
    shapes = [(3,), (500, 7), (1,), (4096,)]
    reps = [[torch.randn(s, device="cuda:0") for s in shapes] for _ in range(3)]
    expected = [model_average([reps[r][t].cpu().numpy().ravel() for r in range(3)], "float32")
                for t in range(len(shapes))]
    pympgu.average_many(reps)
    for t in range(len(shapes)):
        assert np.array_equal(reps[0][t].cpu().numpy().ravel(), expected[t])


def test_stream_wait_for_orders_after_a_framework_stream():
    """Stream.wait_for(handle): pympgu's stream waits for what another framework queued on
    its stream (a sleep, then a fill), though that stream is not the current one that
    DLPack's handshake orders after."""
    torch = pytest.importorskip("torch")
    pympgu.cuda.set_device(0)
    x = torch.zeros(1 << 20, device="cuda:0")
    y = torch.full_like(x, -1.0)
    ours = pympgu.cuda.Stream()
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the average would run before the fill
        x.fill_(1.0)
    ours.wait_for(side.cuda_stream)
    pympgu.average([x], out=y, stream=ours, synchronize=False)
    ours.synchronize()
    assert torch.all(y == 1.0), "the average ran before the side stream's fill"
    ours.close()


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_wire_kernels_match_host(wire, seed):
    """The multi-tensor delta and the accumulation on the GPU, bit for bit against the host
    functions, over odd lengths and offsets that break 16-byte alignment."""
    torch = pytest.importorskip("torch")
    from pympgu._host import host_accumulate, host_delta
    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[wire]
    rng = np.random.default_rng(seed)
    sizes, shift = [1, 5, 4096, 100_003, 1_000_001], [0, 1, 0, 3, 2]
    xs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    refs = [x - (rng.standard_normal(n) * 0.01).astype(np.float32) for x, n in zip(xs, sizes)]
    xs[3][7] = np.inf
    # each x is a slice starting `shift` elements into a larger tensor: unaligned pointers
    dx = [torch.from_numpy(np.concatenate([np.zeros(s, np.float32), x])).cuda()[s:]
          for x, s in zip(xs, shift)]
    dref = [torch.from_numpy(r).cuda() for r in refs]
    dwire = [torch.full((n,), float("nan"), dtype=tdtype, device="cuda:0") for n in sizes]
    table = pympgu.cuda.TensorTable(len(sizes), 2, wire, op="delta")
    table.set([((x.data_ptr(), r.data_ptr()), w.data_ptr(), n)
               for x, r, w, n in zip(dx, dref, dwire, sizes)])
    table.launch()
    pympgu.cuda.synchronize()
    for x, r, w, n in zip(xs, refs, dwire, sizes):
        host = np.empty(n, np.uint16)
        host_delta(x, r, host, wire)
        assert np.array_equal(w.view(torch.int16).cpu().numpy().view(np.uint16), host), n
        acc = r.copy()
        host_accumulate(acc, host, wire)
        dacc = torch.from_numpy(r).cuda()
        pympgu.cuda.accumulate(dacc, w)
        assert np.array_equal(dacc.cpu().numpy(), acc, equal_nan=True), n


def test_device_buffer_is_seen_without_a_copy():
    torch = pytest.importorskip("torch")
    with pympgu.cuda.DeviceBuffer(4096, device=0) as buf:
        view = buf.view("float32", (32, 32))
        t = torch.from_dlpack(view)
        assert t.data_ptr() == view.ptr and t.shape == (32, 32)
        t.fill_(3.0)
        torch.cuda.synchronize()
        assert np.all(view.copy_to_host() == 3.0)
        cupy = pytest.importorskip("cupy")
        c = cupy.asarray(view)
        assert c.data.ptr == view.ptr
        b16 = torch.from_dlpack(buf.view("bfloat16", (2048,)))
        assert b16.dtype == torch.bfloat16 and b16.data_ptr() == buf.ptr


def test_cuda_errors_carry_cuda_message():
    with pytest.raises(pympgu.CudaError) as info:
        pympgu.cuda.set_device(999)
    assert info.value.name == "cudaErrorInvalidDevice"
    with pytest.raises(pympgu.CudaError):
        pympgu.cuda.ipc_open_handle(b"\0" * 64)
    pympgu.cuda.get_device_count()  # the error was cleared, the runtime still works


def test_staged_algorithms_need_staging(monkeypatch, pympgu_env):
    cuda = pympgu.cuda
    monkeypatch.delenv("PYMPGU_PUSH_MIN_BYTES", raising=False)
    pympgu_env()
    with cuda.PeerGroup(0, 2, 1 << 20) as small:  # below push_min_bytes: no staging area
        assert small.stage_bytes == 0
        assert small.algorithm(1 << 20) == "twoshot"
        for algo in ("push", "ce"):
            with pytest.raises(ValueError, match="staging=True"):
                small.algorithm(1 << 20, algo)
    big = cuda.push_min_bytes()
    pympgu_env(ce_min_bytes=2 * big)  # read when the group is made
    with cuda.PeerGroup(0, 2, big) as group:
        assert group.stage_bytes == big // 2  # one slot: the peer's half
        assert group.algorithm(big) == "push"
        assert group.algorithm(big - 1) == "twoshot"
        assert group.algorithm(2 * big) == "ce" and group.algorithm(2 * big - 1) == "push"
    with cuda.PeerGroup(0, 4, 1000, staging=True, shadow=True) as group:
        assert group.stage_bytes == 3 * 256  # 3 slots of ceil(1000 / 4) rounded up to 16 B
        # Every area on a 2 MiB page, and the block whole pages (docs/DECISIONS.md,
        # "Page-aligned buffers").
        page = 2 << 20
        assert group.block.nbytes % page == 0
        assert group.data_offset % page == 0 and group.shadow_offset % page == 0
