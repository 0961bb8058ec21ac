"""GPU workers across nodes, as several "nodes" of one host sharing GPU 0: pympgu's kernels
inside each node and NCCL between them (or NCCL alone, method 'nccl'). NCCL_HOSTID per node
makes NCCL take them for separate hosts, which meet over loopback sockets: this checks the
logic bit for bit, and times nothing of a network."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import pympgu

from processes import communicate_all, free_port, kill_session, session_left, wait_until

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(os.path.dirname(HERE), "benchmarks", "two_on_one_gpu.py")
SECRET = "a secret of the GPU nodes' tests, long enough"


def needs_nccl():
    from pympgu import cuda
    try:
        cuda.nccl_load()
    except cuda.CudaError as e:
        pytest.skip(str(e))


def node_env(node, tmp_path):
    """Node ``node``'s environment: a host of its own for NCCL, met over loopback."""
    return dict(os.environ, PYMPGU_SECRET=SECRET, NCCL_HOSTID=f"pympgu-test-node-{node}",
                NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1", PYMPGU_TEST_DIR=str(tmp_path))


def start_node(nnodes, node, port, nlocal, target, args, tmp_path):
    env = node_env(node, tmp_path)
    argv = [sys.executable, os.path.join(HERE, "node_targets.py"), str(nnodes), str(node),
            str(port), str(nlocal), target, json.dumps(args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def run_nodes(nnodes, nlocal, target, args, tmp_path, timeout=400):
    port = free_port(pair=True)
    procs = [start_node(nnodes, k, port, nlocal, target, args, tmp_path) for k in range(nnodes)]
    out = communicate_all(procs, timeout)
    for code, o, e in out:
        assert code == 0, e[-4000:]
    return json.loads(out[0][1].strip().splitlines()[-1])


def lose_node_1(procs, victim, worker):
    """Kill node 1's worker (pid ``worker()``) or its launcher; check that the other node
    stops within 10 s, status 1, and that nothing of either is left running; the
    survivors' stderr."""
    if victim == "a worker of node 1":
        os.kill(worker(), signal.SIGKILL)
        survivors = procs
    else:
        os.kill(procs[1].pid, signal.SIGKILL)
        survivors = [procs[0]]
    t0 = time.monotonic()
    try:
        for p in survivors:
            p.wait(timeout=60)
        stopped = time.monotonic() - t0
    finally:
        for p in procs:
            kill_session(p)
    errs = [p.stderr.read() for p in survivors]
    assert stopped < 10, f"the other node took {stopped:.1f} s to stop"
    assert all(p.returncode == 1 for p in survivors), errs[0][-3000:]
    wait_until(lambda: not any(session_left(p.pid) for p in procs), 10, every=0.2)
    for p in procs:
        assert not session_left(p.pid), f"outlived the run: {session_left(p.pid)}"
    return errs


@pytest.mark.parametrize("nnodes,nlocal,method", [(2, 1, "auto"), (2, 2, "auto"),
                                                  (2, 1, "nccl")])
def test_replicas_across_nodes_are_one_nodes_exchange_bit_for_bit(tmp_path, nnodes, nlocal,
                                                                   method):
    needs_nccl()
    before = set(glob.glob("/dev/shm/pympgu-*"))
    results = run_nodes(nnodes, nlocal, "node_rounds", [4, method], tmp_path)
    assert len(results) == nnodes * nlocal
    assert [r["node"] for r in results] == [k for k in range(nnodes) for _ in range(nlocal)]
    assert len({r["digest"] for r in results}) == 1
    from pympgu import xla
    if xla.available()[0]:
        assert all(r["roads"] == ["python", "xla"] * 2 for r in results)
    assert not set(glob.glob("/dev/shm/pympgu-*")) - before


@pytest.mark.parametrize("flags", [[], ["--overlap"], ["--method", "nccl"]])
def test_two_gpu_nodes_train_as_two_ranks_on_one(tmp_path, flags):
    """python -m pympgu.train on 2 "nodes" of one GPU rank each: replicas compared across
    the nodes every epoch (a difference fails the run), and the losses those of 2 ranks
    on one node (sharing the GPU: the kernels alone), to float32 rounding."""
    needs_nccl()
    from pympgu.training.config import RunConfig
    from pympgu.training.launcher import run as train
    port = free_port(pair=True)
    argv = [sys.executable, "-m", "pympgu.train", "--gpus", "0", "--hidden", "64", "--epochs",
            "2", "--quiet", "--nnodes", "2", "--coordinator", f"127.0.0.1:{port}", *flags]
    procs = [subprocess.Popen(argv + ["--node-rank", str(k)] + (
        ["--out", str(tmp_path / "two")] if k == 0 else []), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=node_env(k, tmp_path), start_new_session=True)
        for k in range(2)]
    (code0, out0, err0), (code1, _, err1) = communicate_all(procs, 400)
    assert code0 == 0, err0[-4000:]
    assert code1 == 0, err1[-4000:]
    assert "2 nodes x" in out0, out0
    two = [json.loads(line) for line in open(tmp_path / "two" / "metrics.jsonl")]
    one = train(RunConfig(backend="jax", devices=(0, 0), hidden=(64,), epochs=2,
                          overlap="--overlap" in flags, method="auto"))
    assert [e["epoch"] for e in two] == [1, 2], two
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["valid_error"] == pytest.approx(b["valid_error"], abs=1e-3), (a, b)


def start_shared(k, port, nnodes, out, *flags, cpu=False):
    """Node ``k`` of ``nnodes`` on this host: python -m pympgu.train with two GPU workers
    sharing GPU 0 (or two CPU workers); node 0 writes to ``out``."""
    workers = ["-m", "pympgu.train", "--cpu", "2"] if cpu else [SHARED, "--gpus", "0"]
    argv = [sys.executable, *workers, "--hidden", "64", "--epochs", "2", "--quiet",
            "--nnodes", str(nnodes), "--coordinator", f"127.0.0.1:{port}", *flags,
            "--node-rank", str(k), *(["--out", str(out)] if k == 0 else [])]
    home = os.path.dirname(os.path.dirname(pympgu.__file__))  # (the script's pympgu)
    env = dict(node_env(k, out.parent), PYMPGU_PIN_CPU_WORKERS="0",
               PYTHONPATH=os.pathsep.join([home, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)


def train_nodes(tmp_path, name, *flags, cpu=False):
    """2 "nodes" of this host (start_shared) trained to the end; node 0's metrics.jsonl
    records."""
    port, out = free_port(pair=True), tmp_path / name
    procs = [start_shared(k, port, 2, out, *flags, cpu=cpu) for k in range(2)]
    for code, _, err in communicate_all(procs, 400):
        assert code == 0, err[-4000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_gpu_nodes_meet_through_the_host_as_cpu_nodes_do(tmp_path):
    """--across-nodes diloco, easgd and average on GPU workers: the kernels inside each
    node, the host between the nodes every H steps. The same bytes cross as on CPU workers
    (the same meetings), the nodes' replicas are compared every epoch (a difference fails
    the run), the road says so, and every way learns."""
    flags = ["--across-nodes", "diloco", "--outer-every", "5"]
    before = set(glob.glob("/dev/shm/pympgu-*"))
    gpu = train_nodes(tmp_path, "gpu", *flags)
    cpu = train_nodes(tmp_path, "cpu", *flags, cpu=True)
    assert [e["between_nodes_bytes"] for e in gpu] == [e["between_nodes_bytes"] for e in cpu]
    assert "between the nodes every 5 steps (diloco) through the host" in gpu[0]["road"], gpu
    for a, b in zip(gpu, cpu):  # one computation, on two kinds of device (TF32's rounding)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2), (a, b)
    easgd = train_nodes(tmp_path, "easgd", "--across-nodes", "easgd", "--outer-every", "5",
                        "--outer-dtype", "int8")
    local = train_nodes(tmp_path, "local", "--across-nodes", "average", "--outer-every", "5")
    assert easgd[0]["between_nodes_bytes"] < gpu[0]["between_nodes_bytes"]
    for records in (gpu, easgd, local):
        assert records[1]["loss"] < records[0]["loss"], records
    assert not set(glob.glob("/dev/shm/pympgu-*")) - before


def test_gpu_diloco_at_rate_1_every_step_is_exact_averaging(tmp_path):
    """G - 1 * (G - mean x) is the mean: DiLoCo at outer rate 1, momentum 0, H = 1 on GPU
    workers trains as every-step exact averaging (NCCL between the nodes), to float32
    rounding; and a run resumed after its first epoch goes on as the one that never
    stopped (the outer momentum in the checkpoint)."""
    needs_nccl()
    every = train_nodes(tmp_path, "every")
    diloco = train_nodes(tmp_path, "diloco", "--across-nodes", "diloco", "--outer-every", "1",
                         "--outer-lr", "1", "--outer-momentum", "0")
    for a, b in zip(every, diloco):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)
    flags = ["--across-nodes", "diloco", "--outer-every", "4"]
    whole = train_nodes(tmp_path, "whole", *flags)
    train_nodes(tmp_path, "half", *flags, "--epochs", "1")
    resumed = train_nodes(tmp_path, "again", "--resume", str(tmp_path / "half"))
    assert [e["epoch"] for e in resumed] == [1, 2]
    # (to the rounding of XLA's GPU reductions, which may differ from run to run)
    assert resumed[1]["loss"] == pytest.approx(whole[1]["loss"], rel=1e-5), (resumed, whole)
    assert resumed[1]["valid_error"] == pytest.approx(whole[1]["valid_error"], abs=2e-3)


def test_gpu_nodes_go_on_without_a_node_whose_worker_died_and_take_it_back(tmp_path):
    """3 nodes x 2 GPU workers sharing GPU 0, DiLoCo every 5 steps, --min-workers 4: a
    worker of node 2 killed, its node leaves the run (its launcher stops the peer, whose
    kernels wait for the dead one); nodes 0 and 1 go back to their last meeting and go on,
    their exchange in the node and step re-formed; node 2 started again joins, taking node
    0's state through the host. All three finish every epoch (the nodes compare their
    replicas after each), status 0, nothing left in /dev/shm."""
    from test_nodes import _changes, _workers
    port, out = free_port(pair=True), tmp_path / "run"
    before = set(glob.glob("/dev/shm/pympgu-*"))
    flags = ["--hidden", "16", "--epochs", "200", "--across-nodes", "diloco",
             "--outer-every", "5", "--min-workers", "4"]
    procs = [start_shared(k, port, 3, out, *flags) for k in range(3)]
    metrics = out / "metrics.jsonl"
    try:
        assert wait_until((out / "checkpoint.npz").exists, 300, every=0.1), \
            procs[0].poll() is not None and procs[0].stderr.read()[-3000:]
        t0 = time.monotonic()
        os.kill(max(_workers(procs[2])), signal.SIGKILL)
        assert wait_until(lambda: _changes(metrics), 60, every=0.05)
        went_on = time.monotonic() - t0
        assert procs[2].wait(timeout=60) != 0
        procs.append(start_shared(2, port, 3, out, *flags))
        codes = [p.wait(timeout=400) for p in (procs[0], procs[1], procs[3])]
        errs = [p.stderr.read() for p in (procs[0], procs[1], procs[3])]
    finally:
        for p in procs:
            kill_session(p)
    assert codes == [0, 0, 0], "\n-----\n".join(e[-3000:] for e in errs)
    records = [json.loads(line) for line in open(metrics)]
    assert [r["epoch"] for r in records if "event" not in r][-1] == 200
    changes = [(c["lost"], c["workers"]) for c in _changes(metrics)]
    assert changes == [([4, 5], 4), ([], 6)], (changes, went_on)
    assert not set(glob.glob("/dev/shm/pympgu-*")) - before


def test_a_gpu_node_starts_its_workers_again_when_one_dies_and_every_node_goes_on(tmp_path):
    """2 nodes x 2 GPU workers sharing GPU 0, DiLoCo every 5 steps, --min-workers 2
    --restart-workers 2: a worker of node 1 killed, then one of node 0 (whose launcher
    hosts the run). Each time the dead one's peer is stopped too (its kernels wait for the
    dead one) and both start again; the other node goes back to its last meeting and waits
    for them; they take up what their predecessors kept there (the node's own inner state).
    Both nodes finish every epoch with status 0 and the losses and validation errors of the
    same run beside it that lost nothing; the records say who was lost and which ranks are
    new; no process or /dev/shm name is left."""
    from test_nodes import _changes, _workers
    port, out = free_port(pair=True), tmp_path / "run"
    before = set(glob.glob("/dev/shm/pympgu-*"))
    flags = ["--hidden", "16", "--epochs", "200", "--across-nodes", "diloco",
             "--outer-every", "5", "--min-workers", "2", "--restart-workers", "2"]
    still = tmp_path / "still" / "run"
    still.parent.mkdir()
    procs = [start_shared(k, port, 2, out, *flags) for k in range(2)]
    port = free_port(pair=True)
    procs += [start_shared(k, port, 2, still, *flags) for k in range(2)]
    metrics = out / "metrics.jsonl"
    try:
        assert wait_until((out / "checkpoint.npz").exists, 300, every=0.1), \
            procs[0].poll() is not None and procs[0].stderr.read()[-3000:]
        for i, node in enumerate([1, 0]):
            os.kill(max(_workers(procs[node])), signal.SIGKILL)
            assert wait_until(lambda: len(_changes(metrics)) > i, 120, every=0.05), \
                [p.poll() for p in procs]
        codes = [p.wait(timeout=400) for p in procs]
        errs = [p.stderr.read() for p in procs]
        wait_until(lambda: not any(session_left(p.pid) for p in procs), 10, every=0.2)
        left = [session_left(p.pid) for p in procs]
    finally:
        for p in procs:
            kill_session(p)
    assert codes == [0, 0, 0, 0], "\n-----\n".join(e[-3000:] for e in errs)
    key = lambda r: (r["epoch"], r["loss"], r["valid_error"])  # noqa: E731
    records, undisturbed = ([key(json.loads(line)) for line in open(path) if '"event"' not in line]
                            for path in (metrics, still / "metrics.jsonl"))
    assert len(records) == 200 and records == undisturbed
    changes = [(c["lost"], c["joined"], c["workers"]) for c in _changes(metrics)]
    assert changes == [([3], [2, 3], 4), ([1], [0, 1], 4)], changes
    assert "2 new workers take their places" in errs[0] + errs[1]
    assert not any(left), left
    assert not set(glob.glob("/dev/shm/pympgu-*")) - before


@pytest.mark.parametrize("victim", ["a worker of node 1", "node 1's launcher"])
def test_a_gpu_node_lost_during_training_stops_the_other_within_seconds(tmp_path, victim):
    """Training across 2 GPU "nodes": a node's worker or launcher killed while NCCL and the
    step's XLA call wait for it; the other node stops within 10 s, naming the node, and
    leaves nothing running or in /dev/shm."""
    needs_nccl()
    port = free_port(pair=True)
    out = tmp_path / "run"
    before = set(glob.glob("/dev/shm/pympgu-*"))
    argv = [sys.executable, "-m", "pympgu.train", "--gpus", "0", "--hidden", "64", "--epochs",
            "100000", "--quiet", "--nnodes", "2", "--coordinator", f"127.0.0.1:{port}"]
    procs = [subprocess.Popen(argv + ["--node-rank", str(k)] + (
        ["--out", str(out)] if k == 0 else []), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env=node_env(k, tmp_path), start_new_session=True)
        for k in range(2)]
    def worker():
        pids = subprocess.run(["pgrep", "-f", "-s", str(procs[1].pid), "spawn_main"],
                              capture_output=True, text=True).stdout.split()
        assert pids, session_left(procs[1].pid)
        return int(pids[-1])
    try:
        assert wait_until((out / "checkpoint.npz").exists, 300, every=0.2), \
            "the run did not reach its first epoch"
        errs = lose_node_1(procs, victim, worker)
    finally:
        for p in procs:
            kill_session(p)
    assert all("training failed" in e for e in errs), errs[0][-3000:]
    if victim == "a worker of node 1":
        assert "was killed by signal 9" in errs[0] and "(node 1)" in errs[0], errs[0][-3000:]
        assert f"continue with --resume {out}" in errs[0], errs[0][-3000:]
    else:
        assert "node 1 (" in errs[0] and "its launcher is gone" in errs[0], errs[0][-3000:]
    assert not set(glob.glob("/dev/shm/pympgu-*")) - before


@pytest.mark.parametrize("victim", ["a worker of node 1", "node 1's launcher"])
def test_a_node_lost_during_nccl_stops_every_node_within_seconds(tmp_path, victim):
    needs_nccl()
    port = free_port(pair=True)
    procs = [start_node(2, k, port, 2, "node_forever", ["auto"], tmp_path) for k in range(2)]
    try:
        assert wait_until(lambda: len(glob.glob(str(tmp_path / "*.pid"))) == 4, 240, every=0.2), \
            "the nodes did not start exchanging"
        time.sleep(1.0)
        errs = lose_node_1(procs, victim, lambda: int((tmp_path / "3.pid").read_text()))
    finally:
        for p in procs:
            kill_session(p)
    assert "(node 1)" in errs[0] or "node 1 (" in errs[0], errs[0][-3000:]


def test_a_communicator_whose_peer_never_comes_is_aborted_in_time():
    needs_nccl()
    from pympgu import cuda
    cuda.set_device(0)
    t0 = time.monotonic()
    with pytest.raises(cuda.CudaError, match="did not finish within 2 s.*aborted"):
        cuda.NcclComm(2, 0, cuda.nccl_unique_id(), 2.0)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("procs", [1, 2])
def test_bench_across_nodes_times_the_hierarchy_against_flat_nccl(tmp_path, procs):
    """One rank a node: both roads. Two ranks a node sharing the GPU: the hierarchy alone
    (NCCL refuses two ranks of one host on one GPU), and the table says why."""
    needs_nccl()
    out = subprocess.run([sys.executable, "-m", "pympgu.bench", "--nnodes", "2", "--gpus", "0",
                          "--procs", str(procs), "--sizes", "4K", "1M",
                          "--json", str(tmp_path / "b.json")],
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "hierarchy us" in out.stdout, out.stdout
    rows = json.load(open(tmp_path / "b.json"))["results"]
    assert [r["bytes"] for r in rows] == [4096, 1 << 20]
    assert all(r["hierarchy"]["us"] > 0 for r in rows)
    if procs == 1:
        assert "flat/hierarchy" in out.stdout, out.stdout
        assert all(r["flat"]["us"] > 0 for r in rows)
    else:
        assert "flat NCCL not timed: ranks of a node share a GPU" in out.stdout, out.stdout
        assert all("flat" not in r for r in rows)
