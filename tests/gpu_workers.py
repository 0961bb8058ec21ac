"""Worker processes for the GPU tests: one process per replica, handles swapped over pipes.

Functions here run in spawned children, so they live in an importable module. Each child
reports a result or its traceback; the parent checks every exit code.
"""
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
