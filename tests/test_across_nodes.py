"""Between nodes every H steps, exact inside them (--across-nodes average|diloco|easgd), on
CPU workers: the outer optimizers against their formulas, the runs of two nodes of two
workers on one host, and what is refused."""
import json
import os
import signal
import sys

import numpy as np
import pytest

from pympgu.exchange.outer import EASGD, DiLoCo
from pympgu.training import RunConfig
from pympgu.training.config import UsageError
from processes import kill_session, wait_until
from test_nodes import _changes, _workers, finish, free_port, node_argv, start

pytestmark = pytest.mark.timeout(300)


def _outer_round(outers, sums, total, count, everything):
    """One outer exchange of 2 nodes x L slices as the host backend makes it: each rank's
    due range stepped, the contributions summed across the nodes, finished. Returns each
    node's parameters after it (NaN where nothing was due) and the global range due."""
    nnodes, nlocal = len(outers), len(outers[0])
    chunk = -(-total // nlocal)
    results = [np.full(count, np.nan, np.float32) for _ in range(nnodes)]
    due = []
    for k in range(nlocal):
        lo, hi = k * chunk, min(total, (k + 1) * chunk)
        n = max(0, min(hi, count) - lo)
        ats = [outers[node][k].due(lo, lo + n, everything) for node in range(nnodes)]
        assert len(set((a.start, a.stop) for a in ats)) == 1  # the turns alike everywhere
        at = ats[0]
        due += range(lo + at.start, lo + at.stop)
        parts = []
        for node in range(nnodes):
            part = sums[node][lo:hi][at].copy()
            outers[node][k].step(part, at, nlocal)
            parts.append(part)
        across = parts[0] + parts[1]  # what the sum across the nodes gives every node
        for node in range(nnodes):
            results[node][lo + at.start:lo + at.stop] = outers[node][k].finish(
                across, at, everything)
    return results, np.array(due, int)


def _outers(kind, total, count, nlocal, nnodes, start, **settings):
    chunk = -(-total // nlocal)
    outers = [[kind(count, total, chunk, nnodes, **settings) for _ in range(nlocal)]
              for _ in range(nnodes)]
    for node in outers:
        for k, o in enumerate(node):
            lo = k * chunk
            n = max(0, min(lo + chunk, count) - lo)
            o.reset(start[lo:lo + n].copy(), slice(0, n))
    return outers


@pytest.mark.parametrize("streams", [1, 2])
def test_the_outer_step_is_nesterovs_sgd_on_the_mean_pseudo_gradient(seed, streams):
    """Two nodes of two ranks, rank k of each node its slice: G -= lr (d + mu v), v = mu v
    + d, d the nodes' mean of G - x, x a node's mean; every node the same bits. In F
    streams, each exchange steps the next fragment's elements alone, each every F."""
    rng = np.random.default_rng(seed)
    total, count, nlocal, nnodes = 10, 7, 2, 2
    g0 = rng.standard_normal(total).astype(np.float32)
    lr, mu = 0.7, 0.9
    v_ref = np.zeros(count, np.float32)
    g_ref = g0[:count].copy()
    outers = _outers(DiLoCo, total, count, nlocal, nnodes, g0, streams=streams, lr=lr,
                     momentum=mu)
    for turn in range(4):
        # Each node's sums of its ranks' states, different per node.
        sums = [rng.standard_normal(total).astype(np.float32) * nlocal for _ in range(nnodes)]
        results, due = _outer_round(outers, sums, total, count, False)
        fragment = turn % streams
        assert list(due) == list(range(fragment * count // streams,
                                       (fragment + 1) * count // streams))
        d = np.mean([g_ref - s[:count] / nlocal for s in sums], axis=0)[due]
        v_ref[due] = mu * v_ref[due] + d
        g_ref[due] = g_ref[due] - lr * (d + mu * v_ref[due])
        assert np.array_equal(results[0][due], results[1][due])
        np.testing.assert_allclose(results[0][due], g_ref[due], rtol=1e-5, atol=1e-6)
    _, due = _outer_round(outers, sums, total, count, True)  # the epoch's end: all of them
    assert list(due) == list(range(count))


def test_easgd_pulls_each_node_and_the_centre_toward_each_other(seed):
    """Two nodes of two ranks: d = x - c, x -= alpha d, c += alpha (sum of d), c before the
    step on both sides; every node the same centre bits, and at the epoch's end (everything)
    every node takes the centre."""
    rng = np.random.default_rng(seed)
    total, count, nlocal, nnodes, alpha = 10, 7, 2, 2, np.float32(0.45)
    c_ref = rng.standard_normal(total).astype(np.float32)
    outers = _outers(EASGD, total, count, nlocal, nnodes, c_ref, alpha=alpha)
    c_ref = c_ref[:count]
    for everything in (False, False, True):
        sums = [rng.standard_normal(total).astype(np.float32) * nlocal for _ in range(nnodes)]
        results, _ = _outer_round(outers, sums, total, count, everything)
        xs = [s[:count] / nlocal for s in sums]
        ds = [x - c_ref for x in xs]
        c_ref = c_ref + alpha * (ds[0] + ds[1])
        if everything:
            assert np.array_equal(results[0], results[1])
            np.testing.assert_allclose(results[0], c_ref, rtol=1e-5, atol=1e-6)
        else:
            for node in range(nnodes):
                np.testing.assert_allclose(results[node], xs[node] - alpha * ds[node],
                                           rtol=1e-5, atol=1e-6)
    for node in range(nnodes):  # the centre: the same bits on every node
        assert np.array_equal(np.concatenate([o.c for o in outers[node]])[:count],
                              np.concatenate([o.c for o in outers[0]])[:count])


@pytest.mark.parametrize("kind,settings,shared", [
    (DiLoCo, dict(lr=0.7, momentum=0.9), ["g", "v"]), (EASGD, dict(alpha=0.3), ["c"])])
def test_an_overlapped_meeting_moves_the_parameters_as_a_blocking_one_would_have(
        seed, kind, settings, shared):
    """--outer-overlap: the fragment goes on from the node's mean, its sum across the nodes
    runs on a thread, and once settled the parameters move by what the blocking outer step
    would have changed (its result minus the mean it began from); the state the nodes share
    ends as the blocking step's."""
    import types

    from pympgu.exchange.host import HostBackend
    rng = np.random.default_rng(seed)
    n = 12
    start, sums, other, later = (rng.standard_normal(n).astype(np.float32) for _ in range(4))

    class Sum:  # the other node's contribution, as the sum across the nodes adds it
        def __call__(self, x, wire=None, check=None):
            return x + other

        def sent_bytes(self, k, wire=None):
            return 4 * k

    def backend(overlap):
        b = HostBackend.__new__(HostBackend)
        b.ctx, b.nranks = types.SimpleNamespace(check=lambda: None, nranks=4), 2
        b.across, b.across_bytes, b.overlap, b.beside = Sum(), 0, overlap, None
        b.outer = kind(n, n, n, 2, **settings)
        b.outer.reset(start.copy(), slice(0, n))
        return b
    blocking, overlapped = backend(0), backend(1)
    moved = np.empty(n, np.float32)
    blocking._outer(sums.copy(), moved, 0, n, False)
    mine = np.empty(n, np.float32)
    overlapped._outer(sums.copy(), mine, 0, n, False)
    assert np.array_equal(mine, sums / np.float32(2))  # the node's mean, meanwhile
    assert overlapped.across_bytes == blocking.across_bytes == 4 * n
    now = later.copy()
    overlapped._settle(now)
    assert overlapped.beside is None
    assert np.array_equal(now, later + (moved - sums / np.float32(2)))
    for attr in shared:
        assert np.array_equal(getattr(overlapped.outer, attr), getattr(blocking.outer, attr))


def test_the_outer_optimizers_are_one_registry():
    from pympgu.exchange import outer
    from pympgu.training.config import ACROSS_NODES
    assert set(outer.NAMES) == {"diloco", "easgd"}
    assert set(outer.NAMES) < set(ACROSS_NODES)
    for name, kind in outer.REGISTRY.items():
        assert kind.name == name
        fields = {f for f in RunConfig.__dataclass_fields__}
        assert set(kind.flags.values()) <= fields, name  # every setting a RunConfig field


def test_a_compressed_wire_costs_what_it_says():
    from pympgu.exchange.across import NodeSum
    assert NodeSum.wire_bytes(1000) == 4000
    assert NodeSum.wire_bytes(1000, "bfloat16") == 2000
    assert NodeSum.wire_bytes(1000, "int8") == 1000 + 4 * 4


@pytest.mark.parametrize("changes,message", [
    (dict(across_nodes="diloco"), "is between nodes: give --nnodes 2 or more"),
    (dict(across_nodes="diloco", nnodes=2, devices=(0, 1), method="nccl"),
     "--method nccl spans every node; with --across-nodes diloco the GPU exchange stays"),
    (dict(across_nodes="average", nnodes=2, overlap=True), "drop --overlap"),
    (dict(across_nodes="diloco", nnodes=2, outer_every=0), "--outer-every must be at least 1"),
    (dict(across_nodes="diloco", nnodes=2, outer_momentum=1.0), "--outer-momentum must be"),
    (dict(across_nodes="sometimes", nnodes=2), "--across-nodes must be one of"),
    (dict(across_nodes="average", nnodes=2, outer_dtype="int8"),
     "int8 is what an outer optimizer sends: give --across-nodes diloco or easgd"),
    (dict(across_nodes="diloco", nnodes=2, easgd_alpha=0.1), "--easgd-alpha is EASGD's"),
    (dict(across_nodes="easgd", nnodes=2, easgd_alpha=0.6),
     "--easgd-alpha must be above 0 and at most 1 / nodes (1/2), got 0.6"),
    (dict(across_nodes="easgd", nnodes=2, easgd_alpha=0.0), "--easgd-alpha must be above 0"),
    (dict(across_nodes="average", nnodes=2, outer_streams=2), "--outer-streams is for an"),
    (dict(across_nodes="diloco", nnodes=2, outer_every=4, outer_streams=5),
     "--outer-streams must be 1 to --outer-every (4), got 5"),
    (dict(across_nodes="average", nnodes=2, outer_overlap=1), "--outer-overlap is for an"),
    (dict(across_nodes="diloco", nnodes=2, outer_every=6, outer_streams=3, outer_overlap=2),
     "--outer-overlap must be 0 to 1 (a fragment's meeting ends before the next one"),
    (dict(across_nodes="easgd", nnodes=2, outer_overlap=1, sync_every=2),
     "--outer-overlap counts the node's exchanges of the whole state"),
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
    # 15 steps an epoch: 14 exchanges of the parameters alone (half the state; each rank
    # keeps its momentum), the whole state at the epoch's last.
    state = every[0]["between_nodes_bytes"] // 8
    assert [e["between_nodes_bytes"] for e in every] == [8 * state] * 2
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


def test_easgd_sends_the_distances_and_brings_the_nodes_together(tmp_path):
    """EASGD sends each node's distance from the centre (the parameters' size) every H
    steps, and the inner optimizer's state at the epoch's end, when every node takes the
    centre: the nodes' replicas are then compared (a difference fails the run); it learns,
    with the wire in float32 or int8."""
    every = _two_nodes(tmp_path, "every")
    state = every[0]["between_nodes_bytes"] // 8  # 14 halves of the state, and one whole
    easgd = _two_nodes(tmp_path, "easgd", "--across-nodes", "easgd", "--outer-every", "5")
    assert [e["between_nodes_bytes"] for e in easgd] == [2 * state] * 2
    int8 = _two_nodes(tmp_path, "int8", "--across-nodes", "easgd", "--outer-every", "5",
                      "--outer-dtype", "int8", "--easgd-alpha", "0.3")
    assert int8[0]["between_nodes_bytes"] < 0.8 * 2 * state
    for records in (easgd, int8):
        assert records[1]["loss"] < records[0]["loss"], records


def test_streams_send_one_fragment_at_a_time(tmp_path):
    """--outer-streams 3 at H = 6: a third of the parameters crosses every 2 steps (steps 2
    to 14 of 15), the whole state at the epoch's end; the nodes end alike, and it learns."""
    every = _two_nodes(tmp_path, "every")
    state = every[0]["between_nodes_bytes"] / 8  # 14 halves of the state, and one whole
    streams = _two_nodes(tmp_path, "streams", "--across-nodes", "diloco", "--outer-every",
                         "6", "--outer-streams", "3")
    for e in streams:
        assert e["between_nodes_bytes"] == pytest.approx((7 / 3 * 0.5 + 1) * state, rel=0.01)
    assert streams[1]["loss"] < streams[0]["loss"], streams
    # Each fragment's meeting beside the next step: the same bytes, the nodes alike at the
    # epoch's end (compared), and it learns.
    beside = _two_nodes(tmp_path, "beside", "--across-nodes", "diloco", "--outer-every",
                        "6", "--outer-streams", "3", "--outer-overlap", "1")
    assert [e["between_nodes_bytes"] for e in beside] == \
        [e["between_nodes_bytes"] for e in streams]
    assert beside[1]["loss"] < beside[0]["loss"], beside


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


@pytest.mark.parametrize("kind,settings", [(DiLoCo, {"streams": 2}), (EASGD, {})])
def test_a_run_that_goes_back_takes_the_outer_state_back(seed, kind, settings):
    """What a recovery keeps of an outer optimizer (Outer.snapshot) and puts back: the
    same round after the restore gives the same bits as before it; between two changes the
    snapshot is the same object (no copy a step)."""
    rng = np.random.default_rng(seed)
    total, count = 50, 40
    start = rng.standard_normal(total).astype(np.float32)
    outers = _outers(kind, total, count, 2, 2, start, **settings)
    sums = [2 * start + rng.standard_normal(total).astype(np.float32) for _ in range(2)]
    _outer_round(outers, sums, total, count, False)  # a state of its own (momentum, turn)
    kept = [[o.snapshot() for o in node] for node in outers]
    assert all(o.snapshot() is s for node, ks in zip(outers, kept) for o, s in zip(node, ks))
    first, _ = _outer_round(outers, sums, total, count, False)
    for node, ks in zip(outers, kept):
        for o, s in zip(node, ks):
            o.restore(s)
    again, _ = _outer_round(outers, sums, total, count, False)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("flags", [("--outer-every", "5"), ("--outer-every", "6",
                                    "--outer-streams", "2", "--outer-overlap", "2")],
                         ids=["blocking", "overlapped"])
def test_diloco_goes_on_without_a_lost_node_and_takes_it_back(tmp_path, flags):
    """3 nodes x 1 worker, DiLoCo, --min-workers 2: node 2's launcher killed; nodes 0 and 1
    go back to their last common exchange with the outer state they held there and go on
    (overlapped: to the last fragment settled, a sum on the way, whose link to node 2
    closed, left); node 2 started again joins, taking node 0's state and its slice of the
    outer state (the nodes compare their replicas after every epoch: a joiner with an outer
    state of its own would differ), and the three finish every epoch, status 0."""
    port = free_port()
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "pympgu.train", "--cpu", "1", "--hidden", "16", "--epochs",
            "300", "--across-nodes", "diloco", *flags, "--min-workers", "2",
            "--nnodes", "3", "--coordinator", f"127.0.0.1:{port}"]
    node = lambda k: start(argv + ["--node-rank", str(k),  # noqa: E731
                                   *(["--out", str(out)] if k == 0 else [])])
    procs = [node(k) for k in range(3)]
    metrics = out / "metrics.jsonl"
    changes = lambda: _changes(metrics)  # noqa: E731
    try:
        assert wait_until((out / "checkpoint.npz").exists, 120, every=0.05)
        os.kill(procs[2].pid, signal.SIGKILL)
        assert wait_until(lambda: changes(), 60, every=0.05)
        procs.append(node(2))
        codes = [p.wait(timeout=200) for p in (procs[0], procs[1], procs[3])]
        errs = [p.stderr.read() for p in (procs[0], procs[1], procs[3])]
    finally:
        for p in procs:
            kill_session(p)
    assert codes == [0, 0, 0], "\n-----\n".join(e[-3000:] for e in errs)
    records = [json.loads(line) for line in open(metrics)]
    assert [r["epoch"] for r in records if "event" not in r][-1] == 300
    assert [(c["lost"], c["joined"], c["workers"]) for c in changes()] == \
        [([2], [], 2), ([], [2], 3)], changes()


DILOCO = ("--epochs", "6", "--across-nodes", "diloco", "--outer-every", "6", "--outer-streams",
          "2")


@pytest.fixture(scope="module")
def diloco_undisturbed(tmp_path_factory):
    """The epochs of 2 nodes x 2 workers under DiLoCo with 2 streams and ``flags``, nothing
    lost (each run once)."""
    runs = {}

    def run(*flags):
        if flags not in runs:
            port, out = free_port(), tmp_path_factory.mktemp("diloco") / "run"
            procs = [start(node_argv(k, port, *DILOCO, *flags,
                                     *(["--out", str(out)] if k == 0 else [])))
                     for k in range(2)]
            (code0, _, err0), (code1, _, err1) = finish(procs)
            assert (code0, code1) == (0, 0), (err0[-3000:], err1[-3000:])
            runs[flags] = [json.loads(line) for line in open(out / "metrics.jsonl")]
        return runs[flags]
    return run


# A node's first worker: with momentum SGD's state as large as the parameters, the second
# worker's slice of a node's state is the momentum alone, and holds no outer slice. With
# --outer-overlap a fragment's sum runs across the nodes for 2 of every 3 steps: a kill
# mostly finds one on the way.
@pytest.mark.parametrize("node,flags", [(1, ()), (0, ()), (1, ("--outer-overlap", "2"))],
                         ids=["node1", "node0", "node1-overlapped"])
def test_a_worker_restarted_under_diloco_takes_its_outer_slice_from_another_node(
        tmp_path, node, flags, diloco_undisturbed):
    """2 nodes x 2 workers, DiLoCo with 2 streams, --restart-workers: node 1's (or node 0's)
    first worker killed; every node goes back to the nodes' last meeting with the outer
    state it held there (overlapped: the last settled fragment, leaving the sum on the way),
    the new worker takes its node's replica and, from the other node's worker of its local
    index, its slice of the global parameters, the momentum and the fragments' turn. The 4
    then redo the same steps: every epoch's loss and validation error equal those of a run
    that lost nothing (a replacement that re-formed its slice from the replicas, or nodes
    whose inner states were averaged at the re-forming, would not)."""
    port = free_port()
    out = tmp_path / "run"
    procs = [start(node_argv(k, port, *DILOCO, *flags, "--min-workers", "2",
                             "--restart-workers", "1",
                             *(["--out", str(out)] if k == 0 else []))) for k in range(2)]
    metrics = out / "metrics.jsonl"
    changes = lambda: _changes(metrics)  # noqa: E731
    try:
        assert wait_until((out / "checkpoint.npz").exists, 120, every=0.05)
        os.kill(min(_workers(procs[node])), signal.SIGKILL)
        assert wait_until(changes, 60, every=0.05)
        (code0, _, err0), (code1, _, err1) = finish(procs)
    finally:
        for p in procs:
            kill_session(p)
    assert (code0, code1) == (0, 0), (err0[-3000:], err1[-3000:])
    lost = 2 * node
    change, = changes()
    assert (change["lost"], change["joined"], change["workers"]) == ([lost], [lost], 4)
    # An epoch's loss is rank 0's batches' mean: a new rank 0 counts the part of the epoch
    # before it by its node's survivor's batches.
    key = lambda r: (r["epoch"], r["valid_error"],  # noqa: E731
                     None if lost == 0 and r["epoch"] == change["epoch"] else r["loss"])
    done = [r for r in (json.loads(line) for line in open(metrics)) if "event" not in r]
    assert [key(r) for r in done] == \
        [key(r) for r in diloco_undisturbed(*flags) if "event" not in r]


@pytest.mark.parametrize("node", [1, 0])
def test_a_node_that_starts_every_worker_again_under_diloco_loses_nothing(
        tmp_path, node, diloco_undisturbed):
    """2 nodes x 2 workers, DiLoCo with 2 streams, whose nodes start every worker again when
    one is lost, as GPU workers' nodes do: a worker of node 1 (or node 0) killed. Its node's
    new workers take up what their predecessors kept at the nodes' last meeting (the node's
    own inner state, which no other node holds, and the outer slices), so every epoch's loss
    and validation error equal those of a run that lost nothing; taking another node's
    state would not."""
    from test_nodes import start_whole
    port, out = free_port(), tmp_path / "run"
    procs = [start_whole(k, port, *DILOCO, "--min-workers", "2", "--restart-workers", "1",
                         *(["--out", str(out)] if k == 0 else [])) for k in range(2)]
    metrics = out / "metrics.jsonl"
    try:
        assert wait_until((out / "checkpoint.npz").exists, 120, every=0.05)
        os.kill(max(_workers(procs[node])), signal.SIGKILL)
        assert wait_until(lambda: _changes(metrics), 60, every=0.05)
        (code0, _, err0), (code1, _, err1) = finish(procs)
    finally:
        for p in procs:
            kill_session(p)
    assert (code0, code1) == (0, 0), (err0[-3000:], err1[-3000:])
    change, = _changes(metrics)
    assert (change["lost"], change["joined"]) == ([2 * node + 1], [2 * node, 2 * node + 1])
    key = lambda r: (r["epoch"], r["valid_error"], r["loss"])  # noqa: E731
    done = [r for r in (json.loads(line) for line in open(metrics)) if "event" not in r]
    assert [key(r) for r in done] == [key(r) for r in diloco_undisturbed() if "event" not in r]
