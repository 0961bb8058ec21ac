"""Between nodes every H steps, exact inside them (--across-nodes average|diloco), on CPU
workers: DiLoCo's outer step against its formula, the runs of two nodes of two workers on
one host, and what is refused."""
import json

import numpy as np
import pytest

from pympgu.exchange.outer import DiLoCo
from pympgu.training import RunConfig
from pympgu.training.config import UsageError
from test_nodes import finish, free_port, node_argv, start

pytestmark = pytest.mark.timeout(300)


def test_the_outer_step_is_nesterovs_sgd_on_the_mean_pseudo_gradient(seed):
    """Two nodes of two ranks, rank k of each node its slice: G -= lr (d + mu v), v = mu v
    + d, d the nodes' mean of G - x; the inner optimizer's part (past ``count``) averaged."""
    rng = np.random.default_rng(seed)
    total, count, nlocal, nnodes = 10, 7, 2, 2
    chunk = -(-total // nlocal)
    g0 = rng.standard_normal(total).astype(np.float32)
    lr, mu = 0.7, 0.9
    v_ref = np.zeros(count, np.float32)
    g_ref = g0[:count].copy()
    outers = [[DiLoCo(count, total, chunk, lr, mu, nnodes) for _ in range(nlocal)]
              for _ in range(nnodes)]
    for node in outers:
        for k, o in enumerate(node):
            lo, hi = k * chunk, min(total, (k + 1) * chunk)
            o.reset(g0[lo:hi].copy(), lo, hi)
    for _ in range(3):
        # Each node's mean state x (its ranks' sum in the slices), different per node.
        sums = [rng.standard_normal(total).astype(np.float32) * nlocal for _ in range(nnodes)]
        results = [np.empty(total, np.float32) for _ in range(nnodes)]
        for k in range(nlocal):
            lo, hi = k * chunk, min(total, (k + 1) * chunk)
            parts = []
            for node in range(nnodes):
                part = np.zeros(chunk, np.float32)
                part[:hi - lo] = sums[node][lo:hi]
                outers[node][k].step(part, lo, hi, nlocal)
                parts.append(part)
            across = parts[0] + parts[1]  # what the sum across the nodes gives every node
            for node in range(nnodes):
                outers[node][k].finish(across[:hi - lo], results[node][lo:hi], lo, hi,
                                       nlocal * nnodes)
        d = np.mean([g_ref - s[:count] / nlocal for s in sums], axis=0)
        v_ref = mu * v_ref + d
        g_ref = g_ref - lr * (d + mu * v_ref)
        assert np.array_equal(results[0], results[1])  # every node the same bits
        np.testing.assert_allclose(results[0][:count], g_ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(results[0][count:],
                                   (sums[0] + sums[1])[count:] / (nlocal * nnodes), rtol=1e-6)


@pytest.mark.parametrize("changes,message", [
    (dict(across_nodes="diloco"), "is between nodes: give --nnodes 2 or more"),
    (dict(across_nodes="diloco", nnodes=2, devices=(0, 1)), "runs on CPU workers only"),
    (dict(across_nodes="average", nnodes=2, overlap=True), "drop --overlap"),
    (dict(across_nodes="diloco", nnodes=2, outer_every=0), "--outer-every must be at least 1"),
    (dict(across_nodes="diloco", nnodes=2, outer_momentum=1.0), "--outer-momentum must be"),
    (dict(across_nodes="sometimes", nnodes=2), "--across-nodes must be one of"),
])
def test_what_across_nodes_refuses(changes, message):
    with pytest.raises(UsageError) as info:
        RunConfig(**{"devices": (None, None), **changes})
    assert message in str(info.value)


def _two_nodes(tmp_path, name, *flags):
    """Two nodes of two CPU workers on this host; returns node 0's metrics.jsonl records."""
    port = free_port()
    out = tmp_path / name
    procs = [start(node_argv(k, port, "--epochs", "2", *flags,
                             *(["--out", str(out)] if k == 0 else []))) for k in range(2)]
    (code0, _, err0), (code1, _, err1) = finish(procs)
    assert code0 == 0, err0[-3000:]
    assert code1 == 0, err1[-3000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_diloco_at_rate_1_without_momentum_is_local_sgd(tmp_path):
    """G - 1 * (G - mean x) is the mean: DiLoCo at outer rate 1, momentum 0 trains as the
    plain average every H steps does, to float32 rounding; both send fewer bytes between
    the nodes than every step does, by about H; the nodes' replicas are compared every
    epoch (a difference fails the run)."""
    every = _two_nodes(tmp_path, "every")
    local = _two_nodes(tmp_path, "local", "--across-nodes", "average", "--outer-every", "5")
    diloco = _two_nodes(tmp_path, "diloco", "--across-nodes", "diloco", "--outer-every", "5",
                        "--outer-lr", "1", "--outer-momentum", "0")
    for a, b in zip(local, diloco):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)
        assert a["between_nodes_bytes"] == b["between_nodes_bytes"]
    for e, a in zip(every, local):
        # 15 steps an epoch: every step's 15 exchanges against 3 (steps 5, 10 and the last)
        assert e["between_nodes_bytes"] == 5 * a["between_nodes_bytes"], (e, a)


def test_diloco_resumed_goes_on_as_if_never_stopped(tmp_path):
    """The outer momentum is in the checkpoint (the global parameters are the replicas',
    after the epoch's last exchange): a run resumed after its first epoch trains its second
    as the run that never stopped."""
    flags = ["--across-nodes", "diloco", "--outer-every", "4"]
    whole = _two_nodes(tmp_path, "whole", *flags)
    _two_nodes(tmp_path, "half", *flags, "--epochs", "1")
    resumed = _two_nodes(tmp_path, "again", "--resume", str(tmp_path / "half"))
    assert [e["epoch"] for e in resumed] == [1, 2]  # the first from the checkpoint's log
    assert resumed[1]["loss"] == pytest.approx(whole[1]["loss"], rel=1e-6), (resumed, whole)
    assert resumed[1]["valid_error"] == whole[1]["valid_error"]
