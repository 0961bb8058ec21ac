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
    + d, d the nodes' mean of G - x, x a node's mean; every node the same bits."""
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
        # Each node's sums of its ranks' states, different per node.
        sums = [rng.standard_normal(total).astype(np.float32) * nlocal for _ in range(nnodes)]
        results = [np.empty(count, np.float32) for _ in range(nnodes)]
        for k in range(nlocal):
            lo, hi = k * chunk, min(total, (k + 1) * chunk)
            n = max(0, min(hi, count) - lo)
            parts = []
            for node in range(nnodes):
                part = sums[node][lo:hi].copy()
                outers[node][k].step(part, lo, hi, nlocal)
                parts.append(part[:n])
            across = parts[0] + parts[1]  # what the sum across the nodes gives every node
            for node in range(nnodes):
                results[node][lo:lo + n] = outers[node][k].finish(across, lo, hi)
        d = np.mean([g_ref - s[:count] / nlocal for s in sums], axis=0)
        v_ref = mu * v_ref + d
        g_ref = g_ref - lr * (d + mu * v_ref)
        assert np.array_equal(results[0], results[1])
        np.testing.assert_allclose(results[0], g_ref, rtol=1e-5, atol=1e-6)


def test_a_compressed_wire_costs_what_it_says():
    from pympgu.exchange.across import NodeSum
    assert NodeSum.wire_bytes(1000) == 4000
    assert NodeSum.wire_bytes(1000, "bfloat16") == 2000
    assert NodeSum.wire_bytes(1000, "int8") == 1000 + 4 * 4


@pytest.mark.parametrize("changes,message", [
    (dict(across_nodes="diloco"), "is between nodes: give --nnodes 2 or more"),
    (dict(across_nodes="diloco", nnodes=2, devices=(0, 1)), "runs on CPU workers only"),
    (dict(across_nodes="average", nnodes=2, overlap=True), "drop --overlap"),
    (dict(across_nodes="diloco", nnodes=2, outer_every=0), "--outer-every must be at least 1"),
    (dict(across_nodes="diloco", nnodes=2, outer_momentum=1.0), "--outer-momentum must be"),
    (dict(across_nodes="sometimes", nnodes=2), "--across-nodes must be one of"),
    (dict(across_nodes="average", nnodes=2, outer_dtype="int8"),
     "int8 is DiLoCo's pseudo-gradient's"),
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


def test_diloco_sends_h_times_fewer_bytes_and_keeps_the_nodes_alike(tmp_path):
    """Every H steps, and at the epoch's end, the nodes meet: local SGD sends the whole
    state, DiLoCo its pseudo-gradient (the parameters' size; the inner optimizer's state
    at the epoch's end too), in float32, bfloat16 or int8; the nodes' replicas are compared
    every epoch (a difference fails the run), and every way learns."""
    every = _two_nodes(tmp_path, "every")
    local = _two_nodes(tmp_path, "local", "--across-nodes", "average", "--outer-every", "5")
    runs = {dtype: _two_nodes(tmp_path, dtype, "--across-nodes", "diloco", "--outer-every",
                              "5", "--outer-dtype", dtype)
            for dtype in ("float32", "bfloat16", "int8")}
    state = every[0]["between_nodes_bytes"] // 15  # 15 steps an epoch: 15 exchanges
    assert [e["between_nodes_bytes"] for e in every] == [15 * state] * 2
    # Steps 5, 10 and the last (15) of each epoch.
    assert [e["between_nodes_bytes"] for e in local] == [3 * state] * 2
    # Half the state is the parameters: twice their pseudo-gradient, then the whole state.
    assert [e["between_nodes_bytes"] for e in runs["float32"]] == [2 * state] * 2
    bf16 = runs["bfloat16"][0]["between_nodes_bytes"]
    # Three pseudo-gradients at half a float (half the state each), the momentum once.
    assert bf16 == pytest.approx(1.25 * state, rel=0.01)
    assert runs["int8"][0]["between_nodes_bytes"] < bf16
    for records in [every, local, *runs.values()]:
        assert records[1]["loss"] < records[0]["loss"], records  # it learns


def test_diloco_at_rate_1_without_momentum_is_local_sgd_on_the_parameters(tmp_path):
    """G - 1 * (G - mean x) is the mean: DiLoCo at outer rate 1, momentum 0, with H = 1
    (every step), trains as exact averaging every step, to float32 rounding (the momentum
    then stays the node's between epochs' ends, which SGD's parameters do not see: their
    average obeys the averaged momentum's recurrence)."""
    every = _two_nodes(tmp_path, "every")
    diloco = _two_nodes(tmp_path, "diloco", "--across-nodes", "diloco", "--outer-every", "1",
                        "--outer-lr", "1", "--outer-momentum", "0")
    for a, b in zip(every, diloco):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)


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
