"""GPU tests of pympgu's exchange captured in CUDA graphs (PyTorch's), and replayed.

A replay runs the captured kernels again with the arguments they were captured with:
what must change from one exchange to the next (the barriers' counts, 'll''s sequence
numbers) lives in device memory and is counted on by the kernels themselves. Ranks share
GPUs round-robin where fewer are visible; replays are not separated by any host barrier.
"""
import os
import tempfile

import numpy as np
import pytest

from conftest import visible_gpus
from gpu_workers import case_inputs, run_children
from torch_workers import averager_graph, ddp_graph_grads, graph_allreduce
from reference import model_average, same_bits

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

# (n, dtype, method): every algorithm, the DMA one ('ce') too, and every dtype among them.
CASES = [(1000, "float32", "ll"), (4097, "bfloat16", "oneshot"), (65537, "float16", "twoshot"),
         ((1 << 20) + 3, "float32", "push"), ((1 << 20) + 3, "bfloat16", "ce"),
         (300, "float16", "ll")]


@pytest.mark.parametrize("nranks", [2, 3])
def test_captured_exchanges_replay_exact(nranks, seed):
    """Each algorithm, captured with no eager call before, gives at every replay the exact
    rank-order mean of that replay's inputs, on every rank, also after replays back to
    back with no host wait between them."""
    replays = 4
    cases = [(seed + 100 * k, n, dtype, method) for k, (n, dtype, method) in enumerate(CASES)]
    results = run_children(graph_allreduce, nranks, (nranks, visible_gpus(), cases, replays, 20))
    for c, (case_seed, n, dtype, method) in enumerate(cases):
        for i in range(replays + 1):
            inputs = [case_inputs(case_seed + min(i, replays - 1), r, nranks, n, dtype)
                      for r in range(nranks)]
            expected = model_average(inputs, dtype)
            for rank in range(nranks):
                got = np.frombuffer(results[rank][c][i], dtype=expected.dtype)
                what = "after the burst" if i == replays else f"replay {i}"
                assert same_bits(got, expected, dtype), \
                    f"{method} {dtype} n={n}, rank {rank}, {what}: not the exact mean"


@pytest.mark.parametrize("nranks,method", [(2, "auto"), (3, "oneshot")])
def test_ddp_hook_in_a_cuda_graph(nranks, method, seed):
    """DDP's forward and backward with pympgu's hook, captured in a graph and replayed on
    new minibatches: every rank's gradients are the exact mean of the ranks' own at every
    replay."""
    with tempfile.TemporaryDirectory() as tmp:
        results = run_children(ddp_graph_grads, nranks,
                               (nranks, visible_gpus(), os.path.join(tmp, "init"), seed,
                                method, 3))
    for step in range(3):
        owns = [results[r][step][0] for r in range(nranks)]
        assert not np.array_equal(owns[0][0], owns[1][0]), "the ranks' gradients were alike"
        for k in range(len(owns[0])):
            expected = model_average([own[k] for own in owns], "float32")
            for rank in range(nranks):
                assert same_bits(results[rank][step][1][k], expected, "float32"), \
                    f"replay {step}, parameter {k}, rank {rank}: not the exact mean"


@pytest.mark.parametrize("method", ["auto", "twoshot"])
def test_model_averager_in_a_cuda_graph(method):
    """A local step and ModelAverager.average() captured together and replayed: after each
    replay every parameter and momentum is, on every rank, the exact mean of the ranks'
    values before the average; a first average() inside a capture is refused."""
    nranks, replays = 2, 3
    with tempfile.TemporaryDirectory() as tmp:
        results = run_children(averager_graph, nranks,
                               (nranks, visible_gpus(), os.path.join(tmp, "init"), method,
                                replays))
    for i in range(replays):
        befores = [results[r][0][i][0] for r in range(nranks)]
        for k in range(len(befores[0])):
            assert not np.array_equal(befores[0][k], befores[1][k]), \
                f"replay {i}, tensor {k}: alike on every rank before the average"
            expected = model_average([b[k] for b in befores], "float32")
            for rank in range(nranks):
                assert same_bits(results[rank][0][i][1][k], expected, "float32"), \
                    f"replay {i}, tensor {k}, rank {rank}: not the exact mean"
    for rank in range(nranks):
        assert results[rank][1] is not None and "CUDA graph" in results[rank][1], \
            f"rank {rank}: {results[rank][1]}"


def test_a_host_wait_inside_a_capture_says_what_a_capture_takes():
    """allreduce's default host wait, inside a capture: CUDA's error, with what pympgu can
    capture instead."""
    import pympgu
    group = pympgu.cuda.PeerGroup(0, 1, 4096, device=0)
    try:
        group.connect([group.handle])
        raised = None
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                group.stream.wait_for(torch.cuda.current_stream().cuda_stream)
                group.allreduce(16, "float32")  # synchronize=True
        except Exception as e:  # the capture's own end fails after it: look down the chain
            raised = e
        chain = []
        while raised is not None:
            chain.append(raised)
            raised = raised.__context__
        ours = [e for e in chain if isinstance(e, pympgu.CudaError)]
        assert ours, f"no CudaError among {chain!r}"
        assert 900 <= ours[0].status <= 908 and "synchronize=False" in str(ours[0]), ours[0]
        torch.cuda.synchronize()
        group.allreduce(16, "float32")  # the group works on after it
    finally:
        group.close()
