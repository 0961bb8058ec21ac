"""GPU tests of pympgu.ddp: PyTorch DDP with pympgu's exchange as its communication hook.

Ranks share GPUs round-robin where fewer are visible, with gloo carrying DDP's setup (NCCL
refuses two ranks on one GPU); every gradient crosses by pympgu's kernels.
"""
import os
import tempfile

import numpy as np
import pytest

from conftest import visible_gpus
from gpu_workers import run_children
from torch_workers import compiled_averaging, ddp_grads, ddp_refusal, model_averaging
from reference import model_average, same_bits

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("nranks,dtype,method,bucket_view", [
    (2, "float32", "auto", False), (3, "float32", "twoshot", True),
    (2, "bfloat16", "auto", True), (2, "float16", "push", False)])
def test_ddp_gradients_are_the_exact_mean(nranks, dtype, method, bucket_view, seed):
    """After each backward pass every rank holds the same gradients, the rank-order fp32
    mean of the ranks' own, bit for bit, bucket after bucket, before and after DDP rebuilds
    its buckets; and the hook, not DDP's own all-reduce, made them."""
    with tempfile.TemporaryDirectory() as tmp:
        results = run_children(ddp_grads, nranks,
                               (nranks, visible_gpus(), os.path.join(tmp, "init"), seed, dtype,
                                method, bucket_view, 3))
    steps = [r[0] for r in results]
    for rank, (_, places) in enumerate(results):
        assert len(places) >= 3, f"rank {rank}: the hook averaged only {places}"
        assert places == results[0][1], f"rank {rank} laid its buckets out otherwise"
    for step in range(3):
        for k in range(len(steps[0][step][0])):
            expected = model_average([steps[r][step][0][k] for r in range(nranks)], dtype)
            for rank in range(nranks):
                got = np.frombuffer(steps[rank][step][1][k], dtype=expected.dtype)
                assert same_bits(got, expected.ravel(), dtype), \
                    f"step {step}, parameter {k}, rank {rank}: not the exact mean"


def test_ddp_hook_under_torch_compile(seed):
    """torch.compile over DDP with the hook (DDP's optimizer cuts the compiled program at its
    buckets): every rank gets the same gradients, which the hook averaged, and they are the
    mean of the ranks' own (a compiled copy without DDP, whose kernels may round otherwise
    than the cut program's) to float32 rounding."""
    nranks = 2
    with tempfile.TemporaryDirectory() as tmp:
        results = run_children(ddp_grads, nranks,
                               (nranks, visible_gpus(), os.path.join(tmp, "init"), seed,
                                "float32", "auto", False, 3, True), timeout=280)
    for rank, (_, places) in enumerate(results):
        assert places, f"rank {rank}: the hook averaged nothing"
    steps = [r[0] for r in results]
    for step in range(3):
        for k in range(len(steps[0][step][0])):
            owns = [steps[r][step][0][k] for r in range(nranks)]
            assert not np.array_equal(owns[0], owns[1]), "the ranks' gradients were alike"
            got = np.frombuffer(steps[0][step][1][k], dtype=np.float32)
            assert steps[1][step][1][k] == steps[0][step][1][k], \
                f"step {step}, parameter {k}: the ranks' gradients differ"
            np.testing.assert_allclose(got, model_average(owns, "float32").ravel(),
                                       rtol=1e-4, atol=1e-6,
                                       err_msg=f"step {step}, parameter {k}")


def test_ddp_refuses_without_a_process_group():
    import pympgu.ddp
    with pytest.raises(RuntimeError, match="init_process_group"):
        pympgu.ddp.PeerState([torch.zeros(3)])


def test_a_rank_set_up_wrong_is_named_by_every_rank():
    """A rank whose arguments are wrong raises its own error, and its peers, instead of
    waiting for it, raise one that names it."""
    with tempfile.TemporaryDirectory() as tmp:
        errors = run_children(ddp_refusal, 2, (2, visible_gpus(), os.path.join(tmp, "init")),
                              timeout=120)
    assert errors[1].startswith("ValueError: method must be one of ('auto', 'll'"), errors
    assert errors[0].startswith("RuntimeError: pympgu.ddp: not every rank could set up"), errors
    assert "rank 1: ValueError: method must be" in errors[0], errors


@pytest.mark.parametrize("nranks,dtype,optimizer,method", [
    (2, "float32", "sgd", "auto"), (3, "float32", "adam", "twoshot"),
    (2, "bfloat16", "sgd", "push")])
def test_model_averager_gives_every_rank_the_exact_mean(nranks, dtype, optimizer, method):
    """Replicas that differ average to the rank-order mean of every parameter, batch-norm
    statistic and optimizer tensor, on every rank, bit for bit, round after round, also
    for tensors moved out of their places in between; close() leaves them the same values
    in memory of their own, with their strides."""
    with tempfile.TemporaryDirectory() as tmp:
        results = run_children(model_averaging, nranks,
                               (nranks, visible_gpus(), os.path.join(tmp, "init"), dtype,
                                optimizer, method))
    for k in range(2):
        befores = [r[0][k][0] for r in results]
        names = set(befores[0])
        assert any(n.startswith("state") for n in names) and \
            any(n.startswith("buffer") for n in names), names
        assert "parameter 1.bias" not in names  # frozen
        for name in sorted(names):
            inputs = [b[name] for b in befores]
            assert not all(np.array_equal(inputs[0], i) for i in inputs[1:]), \
                f"round {k}: {name} was alike on every rank before the average"
            expected = model_average(inputs, dtype)
            for rank, r in enumerate(results):
                assert same_bits(r[0][k][1][name], expected, dtype), \
                    f"round {k}, rank {rank}: {name} is not the exact mean"
    for rank, (rounds, after_close, inside, strided, frozen_kept) in enumerate(results):
        assert inside == 0, f"rank {rank}: {inside} tensors still in the freed buffer"
        assert strided, f"rank {rank}: the convolution lost its channels-last strides"
        assert frozen_kept, f"rank {rank}: the frozen parameter was moved"
        for name, v in rounds[1][1].items():
            assert np.array_equal(after_close[name], v), f"rank {rank}: close changed {name}"


@pytest.mark.parametrize("flags", [[], ["--graph"]])
def test_local_sgd_example_trains_with_identical_replicas(flags):
    """examples/torch_local_sgd.py, one epoch of the embedded MNIST on 2 ranks, eager and
    with its steps and averages replayed as CUDA graphs: it learns, and every rank holds
    the same bits after each epoch's average (it exits non-zero otherwise)."""
    import json
    import subprocess
    import sys
    gpus = [str(g % visible_gpus()) for g in range(2)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import json, sys; sys.path.insert(0, 'examples'); import torch_local_sgd; "
            f"print(json.dumps(torch_local_sgd.main(['--gpus', *{gpus}, '--epochs', '1', "
            f"'--every', '3', *{flags}])))")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    history = json.loads(done.stdout.strip().splitlines()[-1])
    assert history[0]["identical"] and history[0]["test"] < 25, history


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_model_averager_under_torch_compile(mode):
    """A model under torch.compile (and its CUDA graphs, with 'reduce-overhead'): each
    average is the exact mean on every rank, and the compiled model computes with the
    averaged values (its output matches the eager module's), also after close()."""
    nranks = 2
    with tempfile.TemporaryDirectory() as tmp:
        results = run_children(compiled_averaging, nranks,
                               (nranks, visible_gpus(), os.path.join(tmp, "init"), mode),
                               timeout=280)
    for k in range(3):
        befores = [results[r][k][0] for r in range(nranks)]
        for t in range(len(befores[0])):
            assert not np.array_equal(befores[0][t], befores[1][t]), \
                f"round {k}, tensor {t}: alike on every rank before the average"
            expected = model_average([b[t] for b in befores], "float32")
            for rank in range(nranks):
                assert same_bits(results[rank][k][1][t], expected, "float32"), \
                    f"round {k}, tensor {t}, rank {rank}: not the exact mean"
        for rank in range(nranks):
            assert results[rank][k][2] < 1e-4, \
                f"round {k}, rank {rank}: compiled output {results[rank][k][2]} from eager's"


@pytest.mark.parametrize("nranks,per_host", [(2, 1), (4, 2)])
def test_model_averager_across_hosts_is_the_exact_mean(nranks, per_host):
    """Ranks on several hosts (NCCL_HOSTID apart on this machine): pympgu's kernels inside
    each, NCCL between them; every rank ends with the exact mean of integer replicas, and
    DDP's hook gives it the exact mean of integer gradients."""
    from pympgu import cuda
    try:
        cuda.nccl_load()
    except cuda.CudaError as e:
        pytest.skip(str(e))
    from torch_workers import averaging_across_hosts
    with tempfile.TemporaryDirectory() as tmp:
        results = run_children(averaging_across_hosts, nranks,
                               (nranks, visible_gpus(), os.path.join(tmp, "init"), per_host))
    assert [r["where"] for r in results] == [
        (r // per_host, nranks // per_host, r % per_host) for r in range(nranks)]
    for r in results:
        assert r["got"] == r["want"]
        assert r["places"], "the hook averaged nothing"
        assert r["grad"] == r["grad_want"], "the hook's gradients are not the exact mean"
