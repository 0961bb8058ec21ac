"""GPU tests of pympgu.ddp: PyTorch DDP with pympgu's exchange as its communication hook.

Ranks share GPUs round-robin where fewer are visible, with gloo carrying DDP's setup (NCCL
refuses two ranks on one GPU); every gradient crosses by pympgu's kernels.
"""
import os
import tempfile

import numpy as np
import pytest

from conftest import visible_gpus
from gpu_workers import ddp_grads, ddp_refusal, run_children
from reference import model_average, same_bits

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("nranks,dtype,method,bucket_view", [
    (2, "float32", "auto", False), (3, "float32", "twoshot", True),
    (2, "bfloat16", "auto", True), (2, "float16", "push", False)])
def test_ddp_gradients_are_the_exact_mean(nranks, dtype, method, bucket_view):
    """After each backward pass every rank holds the same gradients, the rank-order fp32
    mean of the ranks' own, bit for bit, bucket after bucket, before and after DDP rebuilds
    its buckets; and the hook, not DDP's own all-reduce, made them."""
    seed = int.from_bytes(os.urandom(3), "little")
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
    assert errors[1].startswith("ValueError: method must be 'auto'"), errors
    assert errors[0].startswith("RuntimeError: pympgu.ddp: not every rank could set up"), errors
    assert "rank 1: ValueError: method must be" in errors[0], errors
