"""Worker processes for the GPU tests: one process per replica, handles swapped over pipes.

Functions here run in spawned children, so they live in an importable module. Each child
reports a result or its traceback; the parent checks every exit code.
"""
import glob
import os
import traceback

import numpy as np

from reference import random_replicas

GUARD = 4096  # bytes after the averaged region that must stay untouched


def case_inputs(seed, rank, nranks, n, dtype, integers=False):
    """The input of one rank for one case; the parent recomputes all ranks' inputs."""
    rng = np.random.default_rng([seed, rank])
    if integers:
        return rng.integers(-1000, 1000, n).astype(np.float32)
    return random_replicas(rng, 1, n, dtype, scale=10.0)[0]


def run_children(target, nranks, args, timeout=240):
    """Start nranks children running target(rank, conn, *args); return their results."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(nranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child, args=(target, rank, child, args), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        handles = [_first_message(pipe, rank, procs, timeout) for rank, pipe in enumerate(pipes)]
        for pipe in pipes:
            pipe.send(handles)
        results = []
        for rank, pipe in enumerate(pipes):
            if not pipe.poll(timeout):
                _fail(procs, f"rank {rank} sent no result within {timeout} s")
            kind, value = pipe.recv()
            if kind == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        for rank, p in enumerate(procs):
            p.join(30)
            assert p.exitcode == 0, f"rank {rank} exited with {p.exitcode}"
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _first_message(pipe, rank, procs, timeout):
    if not pipe.poll(timeout):
        _fail(procs, f"rank {rank} sent no handle within {timeout} s")
    msg = pipe.recv()
    if isinstance(msg, tuple) and msg[0] == "error":
        raise AssertionError(f"rank {rank} failed:\n{msg[1]}")
    return msg


def _fail(procs, why):
    codes = [p.exitcode for p in procs]
    raise AssertionError(f"{why}; exit codes {codes}")


def _child(target, rank, conn, args):
    try:
        conn.send(("result", target(rank, conn, *args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1)


def _poisoned_case(group, x, average, offset=0):
    """Poison the group's buffer, write input x over its part (from byte ``offset``),
    average(), and return the result's bytes and whether the bytes before it and the GUARD
    bytes past it are intact."""
    whole = group.data("uint8", offset + x.nbytes + GUARD)
    whole.fill_bytes(0xA5)
    group.data("uint8", x.nbytes, offset).copy_from_host(x.view(np.uint8))
    average()
    raw = whole.copy_to_host()
    outside = np.concatenate([raw[:offset], raw[offset + x.nbytes:]])
    return raw[offset:offset + x.nbytes].tobytes(), bool(np.all(outside == 0xA5))


def exchange_cases(rank, conn, nranks, ngpus, cases, max_blocks, capacity, offset=0):
    """Average every case through a PeerGroup (from byte ``offset`` of its buffer); returns
    [(bytes, guard intact)] per case."""
    from pympgu import cuda
    group = cuda.PeerGroup(rank, nranks, offset + capacity + GUARD, device=rank % ngpus,
                           timeout=60, staging=True)
    try:
        conn.send(group.handle)
        group.connect(conn.recv(), max_blocks=max_blocks)
        out = []
        for seed, n, dtype, method, integers in cases:
            def average():
                group.barrier()  # nobody starts before every rank has written its input
                if method == "copy":
                    group.copy_average(n, dtype)
                else:
                    assert group.allreduce(n, dtype, algo=method, offset=offset) == method
            out.append(_poisoned_case(group, case_inputs(seed, rank, nranks, n, dtype, integers),
                                      average, offset))
            group.barrier()  # nobody rewrites its input while a peer still reads it
        return out
    finally:
        group.close()


def ll_rounds(rank, conn, nranks, ngpus, plan):
    """Rounds of the 'll' algorithm with no host barrier between them, so that a rank may
    start a round while its peers still read the last: [(bytes, guard intact)] per round."""
    from pympgu import cuda
    capacity = max(n * (4 if d == "float32" else 2) for _, n, d in plan)
    group = cuda.PeerGroup(rank, nranks, capacity + GUARD, device=rank % ngpus, timeout=60)
    try:
        conn.send(group.handle)
        group.connect(conn.recv())
        out = []
        for seed, n, dtype in plan:
            # Only this rank reads its own buffer ('ll' sends from it into the peers'
            # mailboxes), so it may rewrite it while peers are a round behind.
            def average():
                assert group.allreduce(n, dtype, algo="ll") == "ll"
            out.append(_poisoned_case(group, case_inputs(seed, rank, nranks, n, dtype), average))
        return out
    finally:
        group.close()


def resident_rounds(rank, conn, nranks, ngpus, plan, blocks):
    """Every round of plan but the last two through the resident exchange, with no host
    barrier between rounds (as ll_rounds); then, once it has stopped, a launched 'll' round
    (the sequence numbers go on where the kernel left them) and a 'oneshot' round (the
    group works as before). Returns the rounds' [(bytes, guard intact)], what the group
    refused while the kernel ran, and the frees deferred during and after it."""
    from pympgu import cuda
    from pympgu._cuda import _core as _cuda
    capacity = max(n * (4 if d == "float32" else 2) for _, n, d in plan)
    group = cuda.PeerGroup(rank, nranks, capacity + GUARD, device=rank % ngpus, timeout=60)
    try:
        conn.send(group.handle)
        group.connect(conn.recv())
        out, refused = [], []
        with group.resident(blocks) as fast:
            for what, call in [("allreduce", lambda: group.allreduce(8)),
                               ("barrier", group.barrier), ("resident", group.resident),
                               ("synchronize", cuda.synchronize)]:
                try:
                    call()
                except RuntimeError:
                    refused.append(what)
            cuda.DeviceBuffer(1 << 20).close()  # cudaFree would wait for the kernel forever
            deferred = len(_cuda._deferred_frees)
            for seed, n, dtype in plan[:-2]:
                out.append(_poisoned_case(group, case_inputs(seed, rank, nranks, n, dtype),
                                          lambda: fast.allreduce(n, dtype)))
        deferred_after = len(_cuda._deferred_frees)
        seed, n, dtype = plan[-2]
        out.append(_poisoned_case(group, case_inputs(seed, rank, nranks, n, dtype),
                                  lambda: group.allreduce(n, dtype, algo="ll")))
        seed, n, dtype = plan[-1]

        def oneshot():
            group.barrier()  # every rank has written its input
            group.allreduce(n, dtype, algo="oneshot")
        out.append(_poisoned_case(group, case_inputs(seed, rank, nranks, n, dtype), oneshot))
        group.barrier()  # no rank closes while a peer still reads its buffer
        return out, refused, deferred, deferred_after
    finally:
        group.close()


def resident_silent_peer(rank, conn, ngpus, timeout):
    """Rank 0 rings its resident exchange from a thread; rank 1 never does. Meanwhile rank
    0's main thread tries another call and a close. Rank 0 returns the waiting call's error
    and the seconds it took (None if it came back), and what the main thread was refused."""
    import threading
    import time

    from pympgu import CudaError, cuda
    group = cuda.PeerGroup(rank, 2, 4096 + GUARD, device=rank % ngpus, timeout=timeout)
    conn.send(group.handle)
    group.connect(conn.recv())
    if rank == 1:  # keeps its buffer mapped-in until rank 0 has given up on it
        time.sleep(timeout + 3)
        group.close()
        return None
    fast = group.resident(1)
    outcome = {}

    def call():
        t0 = time.monotonic()
        try:
            fast.allreduce(16)
            outcome["error"] = None
        except CudaError as e:
            outcome["error"] = (e.name, str(e), time.monotonic() - t0)
    waiter = threading.Thread(target=call)
    waiter.start()
    time.sleep(0.3)  # the waiter is in its call by now, and stays: nobody rings rank 1
    refused = []
    for what, attempt in [("allreduce", lambda: fast.allreduce(16)), ("close", fast.close)]:
        try:
            attempt()
        except RuntimeError:
            refused.append(what)
    waiter.join(timeout + 30)
    try:  # the trap left the context unusable: teardown fails too, and that is expected
        group.close()
    except CudaError:
        pass
    return outcome.get("error", "no outcome"), refused


def nccl_average(rank, conn, nranks, seed, n, init_file):
    """NCCL all_reduce(AVG) of this rank's integer-valued input, beside pympgu's result."""
    import torch
    import torch.distributed as dist
    conn.send(None)
    conn.recv()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=nranks)
    try:
        t = torch.from_numpy(case_inputs(seed, rank, nranks, n, "float32", True)).cuda()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        torch.cuda.synchronize()
        return t.cpu().numpy().tobytes()
    finally:
        dist.destroy_process_group()


def _gloo_group(rank, conn, nranks, ngpus, init_file):
    """After the parent's go, join a gloo process group of nranks (DDP's setup where ranks
    share GPUs: NCCL refuses that) with this rank's GPU current; returns that GPU."""
    import torch
    import torch.distributed as dist
    conn.send(None)
    conn.recv()
    device = rank % ngpus
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=nranks)
    return device


def ddp_grads(rank, conn, nranks, ngpus, init_file, seed, dtype, method, bucket_view, steps,
              compiled=False):
    """DDP (gloo for its setup) with pympgu.ddp's hook on a small MLP: for each of ``steps``
    backward passes, this rank's gradients unreduced (from a copy of the model) and DDP's,
    as bytes, and the bucket places the hook used. ``compiled``: both called through
    torch.compile."""
    import copy

    import torch
    import torch.distributed as dist

    import pympgu.ddp
    device = _gloo_group(rank, conn, nranks, ngpus, init_file)
    try:
        torch.manual_seed(0)
        kind = getattr(torch, dtype)
        model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(),
                                    torch.nn.Linear(300, 300), torch.nn.Tanh(),
                                    torch.nn.Linear(300, 10)).to(device=device, dtype=kind)
        local = copy.deepcopy(model)
        # Buckets of a KB, so that a backward pass runs several in a row (DDP may lay out
        # its first pass otherwise, and rebuilds its buckets after it). Compiled, DDP's
        # optimizer asserts buckets no smaller than its first (1 MB): then one bucket.
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device], bucket_cap_mb=1 if compiled else 0.001,
            gradient_as_bucket_view=bucket_view)
        state = pympgu.ddp.register(ddp, method=method)

        calls = (torch.compile(local), torch.compile(ddp)) if compiled else (local, ddp)
        out = []
        try:
            gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
            for _ in range(steps):
                x = torch.randn(32, 64, generator=gen).to(device=device, dtype=kind)
                y = torch.randint(0, 10, (32,), generator=gen).to(device)
                for m, call in zip((local, ddp), calls):
                    m.zero_grad(set_to_none=True)
                    torch.nn.functional.cross_entropy(call(x).float(), y).backward()
                out.append(([_raw(p.grad) for p in local.parameters()],
                            [_raw(p.grad).tobytes() for p in model.parameters()]))
            torch.cuda.synchronize()
            # Every rank mapped this rank's stream barrier flags at setup: their name is gone.
            assert not glob.glob(f"/dev/shm/pympgu-flags-{os.getpid()}-*"), "a name stayed"
            return out, sorted(state.places)
        finally:
            state.close()
    finally:
        dist.destroy_process_group()


def ddp_refusal(rank, conn, nranks, ngpus, init_file):
    """pympgu.ddp.register where the last rank passes a method that does not exist: what
    each rank raised (every rank must raise, none wait for the others)."""
    import torch
    import torch.distributed as dist

    import pympgu.ddp
    device = _gloo_group(rank, conn, nranks, ngpus, init_file)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Linear(8, 4).to(device), device_ids=[device])
        try:
            pympgu.ddp.register(ddp, method="bogus" if rank == nranks - 1 else "auto")
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None
    finally:
        dist.destroy_process_group()


def model_averaging(rank, conn, nranks, ngpus, init_file, dtype, optimizer, method):
    """Local SGD with pympgu.ddp.ModelAverager on a small channels-last convnet with batch
    norms, each rank's replica made from its own seed: for two rounds of steps then an
    average (the second after a parameter and an optimizer tensor were moved elsewhere,
    as load_state_dict leaves them), every averaged value before and after, as raw arrays;
    then what close() left: the values, whether any tensor still points into the buffer,
    and whether the convolution kept its channels-last strides."""
    import torch
    import torch.distributed as dist

    import pympgu.ddp
    device = _gloo_group(rank, conn, nranks, ngpus, init_file)
    try:
        torch.manual_seed(rank)  # replicas that differ, so that the mean is worth checking
        kind = getattr(torch, dtype)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)).to(
                device=device, dtype=kind, memory_format=torch.channels_last)
        model[1].bias.requires_grad_(False)  # frozen: left alone
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
               if optimizer == "sgd" else torch.optim.Adam(model.parameters(), lr=1e-3))
        averager = pympgu.ddp.ModelAverager(model, opt, method=method)
        gen = torch.Generator(device="cpu").manual_seed(1000 + rank)

        def values():
            named = {f"parameter {k}": p for k, p in model.named_parameters() if p.requires_grad}
            named.update({f"buffer {k}": b for k, b in model.named_buffers()
                          if b.is_floating_point()})
            for k, p in model.named_parameters():
                for key, v in opt.state.get(p, {}).items():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        named[f"state {key} of {k}"] = v
            torch.cuda.synchronize()
            return {k: _raw(v) for k, v in named.items()}

        def steps(n):
            for _ in range(n):
                x = torch.randn(16, 3, 8, 8, generator=gen).to(device=device, dtype=kind)
                y = torch.randint(0, 10, (16,), generator=gen).to(device)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x).float(), y).backward()
                opt.step()

        rounds = []
        for k in range(2):
            steps(2)
            if k == 1:
                weight = model[4].weight
                weight.data = weight.data.clone()
                state = opt.state[model[0].weight]
                key = sorted(state.keys() - {"step"})[0]
                state[key] = state[key].clone()
            before = values()
            averager.average()
            rounds.append((before, values()))
        lo, hi = averager.flat.data_ptr(), averager.flat.data_ptr() + averager.flat.numel()
        frozen_kept = not lo <= model[1].bias.data_ptr() < hi
        averager.close()
        after_close = values()
        tensors = ([p for p in model.parameters()] + list(model.buffers())
                   + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)])
        inside = sum(lo <= t.data_ptr() < hi for t in tensors)
        strided = model[0].weight.is_contiguous(memory_format=torch.channels_last)
        steps(1)  # the model trains on in its own memory
        torch.cuda.synchronize()
        return rounds, after_close, inside, strided, frozen_kept
    finally:
        dist.destroy_process_group()


def _torch_array(a, dtype):
    """A numpy array in dtype's storage (bfloat16 as uint16) as a CPU torch tensor."""
    import torch
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _raw(t):
    """A torch tensor's values as a flat numpy array in its dtype's storage."""
    import torch
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    return t.cpu().numpy()


def _with_momentum(model, opt):
    """A model's parameters, then SGD's momentum of each: what ModelAverager averages."""
    params = list(model.parameters())
    return params + [opt.state[p]["momentum_buffer"] for p in params]


def graph_allreduce(rank, conn, nranks, ngpus, cases, replays, burst):
    """Each case's exchange (seed, n, dtype, method), with no eager call first, captured
    once in a CUDA graph (torch's, in its strict 'global' mode) between a copy of a static
    input into the group's buffer and a copy of the mean out of it; the graph then
    replayed with a new input each time, and ``burst`` times more back to back, with no
    host barrier or wait between replays. Returns per case each replay's mean, as bytes
    (the last after the burst, of the last input)."""
    import torch

    from pympgu import cuda
    device = rank % ngpus
    torch.cuda.set_device(device)
    capacity = max(n * (4 if d == "float32" else 2) for _, n, d, _ in cases)
    group = cuda.PeerGroup(rank, nranks, capacity, device=device, timeout=60, staging=True)
    try:
        conn.send(group.handle)
        group.connect(conn.recv())
        out = []
        for seed, n, dtype, method in cases:
            view = group.data(dtype, (n,))
            place = torch.from_dlpack(view)
            inp = torch.zeros(n, dtype=getattr(torch, dtype), device=device)
            mean = torch.empty_like(inp)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                stream = torch.cuda.current_stream().cuda_stream
                place.copy_(inp)
                group.stream.wait_for(stream)
                assert group.allreduce(n, dtype, algo=method, synchronize=False) == method
                view.order_before(stream)
                mean.copy_(place)
            means = []
            for i in range(replays):
                inp.copy_(_torch_array(case_inputs(seed + i, rank, nranks, n, dtype), dtype))
                graph.replay()
                means.append(_raw(mean).tobytes())
            for _ in range(burst):
                graph.replay()
            means.append(_raw(mean).tobytes())
            out.append(means)
        torch.cuda.synchronize()
        return out
    finally:
        group.close()


def ddp_graph_grads(rank, conn, nranks, ngpus, init_file, seed, method, steps):
    """DDP with pympgu.ddp's hook, its forward and backward captured in a CUDA graph (after
    the 11 eager steps PyTorch's recipe asks for) beside a copy of the model without DDP,
    and replayed on new minibatches: per replay, this rank's own gradients (the copy's)
    and DDP's, as raw arrays."""
    import copy

    import torch
    import torch.distributed as dist

    import pympgu.ddp
    device = _gloo_group(rank, conn, nranks, ngpus, init_file)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(),
                                    torch.nn.Linear(300, 300), torch.nn.Tanh(),
                                    torch.nn.Linear(300, 10)).to(device)
        local = copy.deepcopy(model)
        x = torch.zeros(32, 64, device=device)
        y = torch.zeros(32, dtype=torch.long, device=device)

        def passes():
            for m in (local, ddp):
                torch.nn.functional.cross_entropy(m(x), y).backward()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device],
                                                            bucket_cap_mb=0.001)
            state = pympgu.ddp.register(ddp, method=method)
            for _ in range(11):
                local.zero_grad(set_to_none=True)
                ddp.zero_grad(set_to_none=True)
                passes()
        torch.cuda.current_stream().wait_stream(side)
        try:
            local.zero_grad(set_to_none=True)
            ddp.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                passes()
            gen = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
            out = []
            for _ in range(steps):
                x.copy_(torch.randn(32, 64, generator=gen))
                y.copy_(torch.randint(0, 10, (32,), generator=gen))
                graph.replay()
                out.append(([_raw(p.grad) for p in local.parameters()],
                            [_raw(p.grad) for p in model.parameters()]))
            torch.cuda.synchronize()
            return out
        finally:
            state.close()
    finally:
        dist.destroy_process_group()


def averager_graph(rank, conn, nranks, ngpus, init_file, method, replays):
    """ModelAverager in a CUDA graph: after one eager step and average (its setup), a whole
    local step (SGD with momentum) and the average captured and replayed on new
    minibatches. Per replay, every averaged tensor before the average (snapshots captured
    in the graph) and after it, as raw arrays; and what a fresh averager's first average()
    raised when called inside a capture."""
    import torch
    import torch.distributed as dist

    import pympgu.ddp
    device = _gloo_group(rank, conn, nranks, ngpus, init_file)
    try:
        torch.manual_seed(rank)  # replicas that differ
        model = torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.Tanh(),
                                    torch.nn.Linear(200, 10)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        averager = pympgu.ddp.ModelAverager(model, opt, method=method)
        x = torch.randn(16, 64, device=device)
        y = torch.randint(0, 10, (16,), device=device)

        def step():
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                step()
                averager.average()
        torch.cuda.current_stream().wait_stream(side)
        try:
            opt.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                step()
                before = [t.clone() for t in _with_momentum(model, opt)]
                averager.average()
            gen = torch.Generator(device="cpu").manual_seed(2000 + rank)
            out = []
            for _ in range(replays):
                x.copy_(torch.randn(16, 64, generator=gen))
                y.copy_(torch.randint(0, 10, (16,), generator=gen))
                graph.replay()
                out.append(([_raw(t) for t in before],
                            [_raw(t) for t in _with_momentum(model, opt)]))
            torch.cuda.synchronize()
        finally:
            averager.close()
        fresh = pympgu.ddp.ModelAverager(torch.nn.Linear(4, 4).to(device), method=method)
        refused = None
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                fresh.average()
        except Exception as e:
            refused = f"{type(e).__name__}: {e}"
        return out, refused
    finally:
        dist.destroy_process_group()


def compiled_averaging(rank, conn, nranks, ngpus, init_file, mode):
    """ModelAverager on a model under torch.compile (``mode``), each rank's replica from its
    own seed: for two rounds of two compiled steps and an average, and once more after
    close(), every averaged tensor before and after the average, as raw arrays, and how
    far the compiled model's output then was from the eager module's on the same input
    (a compiled program that kept reading the tensors' old memory would miss the average)."""
    import torch
    import torch.distributed as dist

    import pympgu.ddp
    device = _gloo_group(rank, conn, nranks, ngpus, init_file)
    try:
        torch.manual_seed(rank)  # replicas that differ
        net = torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.Tanh(),
                                  torch.nn.Linear(200, 10)).to(device)
        model = torch.compile(net, mode=mode)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        averager = pympgu.ddp.ModelAverager(model, opt)
        gen = torch.Generator(device="cpu").manual_seed(3000 + rank)
        probe = torch.randn(32, 64, generator=torch.Generator().manual_seed(7)).to(device)

        def gap():
            with torch.no_grad():
                compiled = model(probe).clone()
                return (compiled - net(probe)).abs().max().item()

        rounds = []
        for k in range(3):
            for _ in range(2):
                x = torch.randn(16, 64, generator=gen).to(device)
                y = torch.randint(0, 10, (16,), generator=gen).to(device)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            before = [_raw(t) for t in _with_momentum(net, opt)]
            averager.average()
            if k == 2:
                averager.close()  # the tensors in memory of their own again
            rounds.append((before, [_raw(t) for t in _with_momentum(net, opt)], gap()))
        return rounds
    finally:
        dist.destroy_process_group()


def averaging_across_hosts(rank, conn, nranks, ngpus, init_file, per_host):
    """ModelAverager and the DDP hook on ranks that play ``nranks // per_host`` hosts
    (NCCL_HOSTID): integer-valued replicas, so that every correct average has one value.
    Returns each averaged tensor's raw bytes and the expected ones."""
    os.environ["NCCL_HOSTID"] = f"pympgu-test-host-{rank // per_host}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    import torch
    import torch.distributed as dist

    import pympgu.ddp
    device = _gloo_group(rank, conn, nranks, ngpus, init_file)
    try:
        def ints(r, n):
            g = torch.Generator().manual_seed(r)
            return torch.randint(-64, 64, (n,), generator=g).float()
        w = torch.nn.Parameter(ints(rank, 1000).cuda(device))
        averager = pympgu.ddp.ModelAverager(torch.nn.ParameterList([w]), buffers=False)
        averager.average()
        torch.cuda.synchronize(device)
        got = w.detach().cpu().numpy().tobytes()
        want = (sum(ints(r, 1000) for r in range(nranks)) / nranks).numpy().tobytes()
        where = (averager.node, averager.nnodes, averager.local)
        averager.close()
        # The hook: the gradient of sum(w . x) is x, an integer vector a rank.
        model = torch.nn.Linear(1000, 1, bias=False).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device])
        state = pympgu.ddp.register(ddp)
        try:
            ddp(ints(100 + rank, 1000).cuda(device)[None]).sum().backward()
            torch.cuda.synchronize(device)
            grad = model.weight.grad.detach().cpu().numpy().tobytes()
            places = len(state.places)
        finally:
            state.close()
        grad_want = (sum(ints(100 + r, 1000) for r in range(nranks)) / nranks).numpy()
        return {"got": got, "want": want, "where": where, "grad": grad,
                "grad_want": grad_want.tobytes(), "places": places}
    finally:
        dist.destroy_process_group()
