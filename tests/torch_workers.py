"""Worker processes for the GPU tests that run PyTorch: DDP's hook, the model averager and
CUDA graphs, one process per replica (gpu_workers.run_children starts them)."""
import glob
import os

import numpy as np

from gpu_workers import case_inputs


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
