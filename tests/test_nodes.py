"""Several nodes on one host: each node's launcher a process of its own on loopback, started
from a plain shell or with the variables of Slurm, Open MPI and torchrun set by hand."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import processes
from processes import kill_session, session_left, wait_until
from pympgu.runtime import nodes

pytestmark = pytest.mark.timeout(300)
SECRET = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
TRAIN = [sys.executable, "-m", "pympgu.train", "--cpu", "2", "--hidden", "16"]


def free_port():
    """A port free here, for node 0's launcher."""
    return processes.free_port()


def start(argv, env=None, secret=SECRET):
    env = dict(os.environ, **(env or {}))
    # Several nodes on one host would each pin their workers to the same cores
    # (pympgu.runtime.cores): left to the kernel, as docs/TRAINING.md advises.
    env.setdefault("PYMPGU_PIN_CPU_WORKERS", "0")
    env.pop(nodes.SECRET_ENV, None)
    if secret:
        env[nodes.SECRET_ENV] = secret
    return processes.start(argv, env)


def node_argv(k, port, *more):
    return TRAIN + ["--nnodes", "2", "--node-rank", str(k), "--coordinator",
                    f"127.0.0.1:{port}", *more]


def finish(procs, timeout=240):
    return processes.communicate_all(procs, timeout)


def epochs(path):
    return [json.loads(line) for line in open(path)]


# ---------------------------------------------------------------- where the nodes are

@pytest.mark.parametrize("env,expected", [
    ({"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-10],cpu1",
      "SLURM_JOB_ID": "123456", "SLURM_NTASKS_PER_NODE": "1"},
     nodes.Nodes(4, 2, "gpu07", nodes.DEFAULT_PORT + 456, "Slurm")),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
      "OMPI_MCA_orte_hnp_uri": "3045.0;tcp://10.1.2.3,172.17.0.1:38271"},
     nodes.Nodes(2, 1, "10.1.2.3", nodes.DEFAULT_PORT, "Open MPI")),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "3", "GROUP_RANK": "1", "RANK": "1",
      "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "head", "MASTER_PORT": "29500"},
     nodes.Nodes(3, 1, "head", 29501, "torchrun")),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
      nodes.COORDINATOR_ENV: "node0:4000"}, nodes.Nodes(2, 0, "node0", 4000, "Open MPI")),
    ({}, None),
])
def test_nodes_come_from_a_job_launchers_variables(env, expected):
    assert nodes.from_environment(env) == expected


@pytest.mark.parametrize("env,flag,message", [
    ({"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "a",
      "SLURM_NTASKS_PER_NODE": "4"}, "SLURM_NTASKS_PER_NODE", "srun --ntasks-per-node=1"),
    ({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, "OMPI_COMM_WORLD_LOCAL_SIZE", "ppr:1:node"),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, nodes.COORDINATOR_ENV,
     f"mpirun -x {nodes.COORDINATOR_ENV}=HOST:PORT"),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "8", "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "8",
      "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "LOCAL_WORLD_SIZE", "--nproc-per-node=1"),
    ({"SLURM_NNODES": "2", "SLURM_NODEID": "5", "SLURM_JOB_NODELIST": "a"}, "--node-rank",
     "0 to 1, got 5"),
])
def test_a_job_that_starts_a_process_per_gpu_is_told_how_to_start_one_per_node(env, flag,
                                                                               message):
    with pytest.raises(nodes.NodesError) as info:
        nodes.from_environment(env)
    assert info.value.flag == flag and message in str(info.value)


def test_flags_are_all_three_or_none(tmp_path):
    assert nodes.resolve(env={}) == nodes.Nodes()
    assert nodes.resolve(2, 1, "h:7", env={}) == nodes.Nodes(2, 1, "h", 7)
    for args, flag in [((None, 1, None), "--nnodes"), ((2, None, "h:7"), "--node-rank"),
                       ((2, 1, None), "--coordinator"), ((2, 1, "h"), "--coordinator"),
                       ((2, 2, "h:7"), "--node-rank"), ((0, 0, "h:7"), "--nnodes")]:
        with pytest.raises(nodes.NodesError) as info:
            nodes.resolve(*args, env={})
        assert info.value.flag == flag, args


def test_the_secret_comes_from_a_private_file_or_the_environment(tmp_path):
    assert nodes.read_secret(env={}) is None
    assert nodes.read_secret(env={nodes.SECRET_ENV: SECRET}) == SECRET.encode()
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    os.chmod(path, 0o644)
    with pytest.raises(nodes.NodesError, match="others may read it .* chmod 600"):
        nodes.read_secret(str(path), env={})
    os.chmod(path, 0o600)
    assert nodes.read_secret(str(path), env={}) == SECRET.encode()
    os.symlink(path, tmp_path / "link")
    with pytest.raises(nodes.NodesError, match="--secret-file"):
        nodes.read_secret(str(tmp_path / "link"), env={})
    with pytest.raises(nodes.NodesError, match="holds 5 bytes; give at least 16"):
        nodes.read_secret(env={nodes.SECRET_ENV: "short"})


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user (needs root)")
def test_a_secret_file_of_another_user_is_refused_whatever_its_mode(tmp_path):
    # Its owner chose the secret and can read it: mode 600 keeps no one else out.
    path = tmp_path / "secret"
    path.write_text(SECRET)
    os.chmod(path, 0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(nodes.NodesError, match="owned by uid 65534, not by this user") as info:
        nodes.read_secret(str(path), env={})
    assert info.value.flag == "--secret-file"
    with pytest.raises(nodes.NodesError, match="not a regular file"):
        nodes.read_secret(str(tmp_path), env={})


def test_a_run_of_several_nodes_without_a_secret_is_refused():
    p = start(node_argv(0, free_port()), secret=None)
    (code, _, err), = finish([p], timeout=60)
    assert code == 2
    assert "a run of 2 nodes (flags) needs a secret the nodes share: export PYMPGU_SECRET" \
        in err, err


# ---------------------------------------------------------------- training on two nodes

@pytest.mark.parametrize("launcher", ["shell", "Slurm", "Open MPI", "torchrun"])
def test_two_nodes_of_two_workers_train_as_four_workers_on_one(tmp_path, launcher):
    """Replicas are compared across the nodes every epoch (a difference fails the run),
    and the losses are those of 4 workers on one node, to float32 rounding."""
    port = free_port()
    out = tmp_path / "run"
    argv = TRAIN + ["--epochs", "3"]
    if launcher == "shell":
        procs = [start(node_argv(k, port, *(["--out", str(out)] if k == 0 else []),
                                 "--epochs", "3")) for k in range(2)]
    else:
        def env(k):
            if launcher == "Slurm":
                return {"SLURM_NNODES": "2", "SLURM_NODEID": str(k),
                        "SLURM_JOB_NODELIST": "localhost",
                        nodes.COORDINATOR_ENV: f"127.0.0.1:{port}"}
            if launcher == "Open MPI":
                return {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(k),
                        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
                        nodes.COORDINATOR_ENV: f"127.0.0.1:{port}"}
            return {"TORCHELASTIC_RUN_ID": "t", "WORLD_SIZE": "2", "GROUP_RANK": str(k),
                    "RANK": str(k), "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port - 1)}
        procs = [start(argv + (["--out", str(out)] if k == 0 else []), env=env(k))
                 for k in range(2)]
    (code0, out0, err0), (code1, _, err1) = finish(procs)
    assert code0 == 0, err0[-3000:]
    assert code1 == 0, err1[-3000:]
    assert "2 nodes x 2 CPU workers" in out0 and "pympgu: node 1 done" in err1
    assert "[Gloo]" not in out0 + err0, out0  # its notice of every connection, dropped
    if launcher != "shell":
        return
    two = epochs(out / "metrics.jsonl")
    one = tmp_path / "one"
    (code, _, err), = finish([start(TRAIN + ["--cpu", "4", "--epochs", "3", "--out", str(one)],
                                    secret=None)])
    assert code == 0, err[-3000:]
    four = epochs(one / "metrics.jsonl")
    assert [e["epoch"] for e in two] == [1, 2, 3]
    for a, b in zip(two, four):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["valid_error"] == pytest.approx(b["valid_error"], abs=1e-3), (a, b)


def _nothing_left(procs, before):
    """No process of the nodes' sessions still runs, and /dev/shm holds no name of theirs
    that was not there ``before``."""
    wait_until(lambda: not any(session_left(p.pid) for p in procs), 10, every=0.2)
    for p in procs:
        assert not session_left(p.pid), f"outlived the run: {session_left(p.pid)}"
    assert not set(glob.glob("/dev/shm/pympgu-*")) - before


def _listening(pid):
    """The TCP ports on which process ``pid`` listens."""
    inodes = set()
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_workers_listen_on_no_port_once_their_data_links_are_up(tmp_path):
    """CPU workers across nodes listen only while their links form (each link proves the
    run's key: tests/test_datalinks.py); once training, no port of theirs takes anyone,
    where a rendezvous open to the network would let a stranger stop the run."""
    port = free_port()
    out = tmp_path / "run"
    procs = [start(node_argv(k, port, "--epochs", "100000",
                             *(["--out", str(out)] if k == 0 else []))) for k in range(2)]
    try:
        assert wait_until((out / "checkpoint.npz").exists, 120, every=0.2)
        workers = [int(p) for proc in procs for p in subprocess.run(
            ["pgrep", "-f", "-s", str(proc.pid), "spawn_main"], capture_output=True,
            text=True).stdout.split()]
        assert len(workers) == 4, [session_left(p.pid) for p in procs]
        assert {w: _listening(w) for w in workers} == {w: [] for w in workers}
        assert all(p.poll() is None for p in procs)
    finally:
        for p in procs:
            kill_session(p)


@pytest.mark.parametrize("victim", ["node 1's launcher", "a worker of node 1"])
def test_with_min_workers_the_other_nodes_go_on_without_a_lost_one(tmp_path, victim):
    """2 nodes x 2 workers, --min-workers 2: node 1 lost (its launcher killed, or a worker
    of it, which fails the node) after the first epoch, node 0's workers go back to their
    last common exchange, re-form alone and finish every epoch, status 0; the record says
    which ranks were lost. Node 1 (where it lives) stops, naming why."""
    port = free_port()
    out = tmp_path / "run"
    before = set(glob.glob("/dev/shm/pympgu-*"))
    procs = [start(node_argv(k, port, "--epochs", "4", "--min-workers", "2",
                             *(["--out", str(out)] if k == 0 else []))) for k in range(2)]
    try:
        assert wait_until((out / "checkpoint.npz").exists, 120, every=0.05)
        if victim == "a worker of node 1":
            workers = [int(p) for p in subprocess.run(
                ["pgrep", "-f", "-s", str(procs[1].pid), "spawn_main"], capture_output=True,
                text=True).stdout.split()]
            os.kill(workers[-1], signal.SIGKILL)
        else:
            os.kill(procs[1].pid, signal.SIGKILL)
        code0, err0 = procs[0].wait(timeout=120), procs[0].stderr.read()
        code1, err1 = procs[1].wait(timeout=30), procs[1].stderr.read()
    finally:
        for p in procs:
            kill_session(p)
    assert code0 == 0, err0[-3000:]
    records = epochs(out / "metrics.jsonl")
    assert [r["epoch"] for r in records if r.get("event") != "membership"][-1] == 4
    changes = [r for r in records if r.get("event") == "membership"]
    assert len(changes) == 1 and changes[0]["lost"] == [2, 3], changes
    why = ("node 1 (" if victim == "node 1's launcher" else "was killed by signal 9")
    assert changes[0]["workers"] == 2 and why in changes[0]["reason"], changes
    assert "node 1 leaves the run; 2 workers on 1 node(s) go on without it" in err0, err0
    assert f"rank 2, 3 lost ({changes[0]['reason']}) at step" in err0, err0[-3000:]
    if victim == "a worker of node 1":
        assert code1 == 1 and "was killed by signal 9" in err1, err1[-3000:]
    _nothing_left(procs, before)


def _workers(proc):
    """The worker processes of a node's launcher ``proc``."""
    return [int(p) for p in subprocess.run(["pgrep", "-f", "-s", str(proc.pid), "spawn_main"],
                                           capture_output=True, text=True).stdout.split()]


EPOCHS = "6"


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """The epochs of 2 nodes x 2 workers, nothing lost; with --min-workers, as the runs it
    is compared with (every exchange then averages the whole state, momentum too)."""
    port, out = free_port(), tmp_path_factory.mktemp("undisturbed") / "run"
    procs = [start(node_argv(k, port, "--epochs", EPOCHS, "--min-workers", "2",
                             *(["--out", str(out)] if k == 0 else []))) for k in range(2)]
    try:
        codes = [p.wait(timeout=150) for p in procs]
    finally:
        for p in procs:
            kill_session(p)
    assert codes == [0, 0], [p.stderr.read()[-3000:] for p in procs]
    return epochs(out / "metrics.jsonl")


def _changes(path):
    return [r for r in epochs(path) if r.get("event") == "membership"] if path.exists() else []


def _kill_in_turn(procs, out, victims):
    """Once node 0 (writing to ``out``) has checkpointed, kill a worker of each of
    ``victims`` (node, which of its workers' pids) in turn, each once the last loss is
    recorded; check that both nodes then end with status 0. Their stderr."""
    try:
        assert wait_until((out / "checkpoint.npz").exists, 120, every=0.05)
        for i, (node, which) in enumerate(victims):
            os.kill(which(_workers(procs[node])), signal.SIGKILL)
            assert wait_until(lambda: len(_changes(out / "metrics.jsonl")) > i, 60,
                              every=0.05)
        codes = [p.wait(timeout=150) for p in procs]
        errs = [p.stderr.read() for p in procs]
    finally:
        for p in procs:
            kill_session(p)
    assert codes == [0, 0], [e[-3000:] for e in errs]
    return errs


# (node, its worker started first or last): a second kill takes the worker that was no
# replacement, which holds the node's state while its new peer holds nothing yet.
@pytest.mark.parametrize("victims", [[(1, max)], [(0, max)], [(1, max), (1, min)]])
def test_a_worker_lost_on_any_node_is_restarted_and_every_node_goes_on(tmp_path, victims,
                                                                       undisturbed):
    """2 nodes x 2 workers, --restart-workers: a worker killed on node 1 (or on node 0,
    whose launcher hosts the run; or node 1's other worker once the first replacement joined)
    is replaced on its node; every node goes back to the last common exchange, waits for
    the new worker, which takes its node's state, and the 4 finish every epoch, status 0
    on both nodes, bit-identical (the launcher checks the digests) and with the losses of a
    run that lost nothing (the same 4 workers redo the same steps); the record says who was
    lost and who joined."""
    port = free_port()
    out = tmp_path / "run"
    before = set(glob.glob("/dev/shm/pympgu-*"))
    procs = [start(node_argv(k, port, "--epochs", EPOCHS, "--min-workers", "2",
                             "--restart-workers", str(len(victims)),
                             *(["--out", str(out)] if k == 0 else []))) for k in range(2)]
    errs = _kill_in_turn(procs, out, victims)
    records = epochs(out / "metrics.jsonl")
    done = [r for r in records if r.get("event") != "membership"]
    assert [(r["epoch"], r["loss"], r["valid_error"]) for r in done] == \
        [(r["epoch"], r["loss"], r["valid_error"]) for r in undisturbed]
    changes = _changes(out / "metrics.jsonl")
    assert len(changes) == len(victims), changes
    for change, (node, which) in zip(changes, victims):
        lost = 2 * node + (which is max)  # (the node's workers in the order they started)
        assert (change["lost"], change["joined"], change["workers"]) == ([lost], [lost], 4), \
            changes
        assert "was killed by signal 9" in change["reason"], changes
        assert (f"a new worker takes its place on node {node}; every node waits for it"
                in errs[0]), errs[0][-3000:]
    _nothing_left(procs, before)


def start_whole(k, port, *more):
    """Node ``k`` of 2 (``node_argv``) whose node starts every worker again when one is
    lost, as GPU workers' nodes do (tests/whole_nodes.py)."""
    whole = [sys.executable, os.path.join(os.path.dirname(__file__), "whole_nodes.py"),
             *TRAIN[3:]]
    home = os.path.dirname(os.path.dirname(os.path.dirname(nodes.__file__)))  # (pympgu's)
    env = {"PYTHONPATH": os.pathsep.join([home, os.environ.get("PYTHONPATH", "")])}
    return start(whole + node_argv(k, port, *more)[len(TRAIN):], env)


def test_a_node_that_starts_every_worker_again_takes_up_its_state(tmp_path, undisturbed):
    """2 nodes x 2 workers whose nodes start every worker again when one is lost, as GPU
    workers' nodes do: a worker of node 1 killed, then one of node 0, whose launcher hosts
    the run. Each time both workers of the node are new and take up what their predecessors
    kept at their last exchanges, while every node waits, and the run ends with status 0 on
    both nodes and the validation errors and losses of the undisturbed run; the records name
    the lost rank and the node's new ranks."""
    port, out = free_port(), tmp_path / "run"
    before = set(glob.glob("/dev/shm/pympgu-*"))
    procs = [start_whole(k, port, "--epochs", EPOCHS, "--min-workers", "2",
                         "--restart-workers", "2", *(["--out", str(out)] if k == 0 else []))
             for k in range(2)]
    errs = _kill_in_turn(procs, out, [(1, max), (0, max)])
    changes = _changes(out / "metrics.jsonl")
    assert [(c["lost"], c["joined"], c["workers"]) for c in changes] == \
        [([3], [2, 3], 4), ([1], [0, 1], 4)], changes
    assert "2 new workers take their places" in errs[1] and \
        "2 new workers take their places" in errs[0], errs
    key = lambda r: (r["epoch"], r["valid_error"], r["loss"])  # noqa: E731
    assert [key(r) for r in epochs(out / "metrics.jsonl") if "event" not in r] == \
        [key(r) for r in undisturbed]
    _nothing_left(procs, before)


def _run_alone_workers(out, port, victim=None):
    """2 nodes x 1 worker, --restart-workers 1, 6 epochs; ``victim``: the node whose only
    worker is killed after the first checkpoint. Returns the launchers' status and stderr."""
    procs = [start(node_argv(k, port, "--cpu", "1", "--epochs", EPOCHS, "--min-workers", "1",
                             "--restart-workers", "1",
                             *(["--out", str(out)] if k == 0 else []))) for k in range(2)]
    try:
        if victim is not None:
            assert wait_until((out / "checkpoint.npz").exists, 120, every=0.05)
            os.kill(min(_workers(procs[victim])), signal.SIGKILL)
            assert wait_until(lambda: _changes(out / "metrics.jsonl"), 60, every=0.05)
        codes = [p.wait(timeout=150) for p in procs]
        return codes, [p.stderr.read() for p in procs], procs
    finally:
        for p in procs:
            kill_session(p)


@pytest.mark.parametrize("victim", [1, 0])
def test_a_nodes_only_worker_restarted_takes_another_nodes_state(tmp_path, victim):
    """2 nodes x 1 worker, --restart-workers: the only worker of node 1 (or of node 0) killed;
    its node then holds nothing, and its new worker takes the other node's state across the
    data links, as a node that joins does. Both nodes end with status 0 (a launcher with no
    worker for a moment waits for the new one), and every epoch has the validation error
    and loss of a run that lost nothing (a new rank 0 counts the part of its epoch before it
    by the other node's batches)."""
    before = set(glob.glob("/dev/shm/pympgu-*"))
    codes, errs, _ = _run_alone_workers(tmp_path / "base", free_port())
    assert codes == [0, 0], [e[-3000:] for e in errs]
    out = tmp_path / "run"
    codes, errs, procs = _run_alone_workers(out, free_port(), victim)
    assert codes == [0, 0], [e[-3000:] for e in errs]
    change, = _changes(out / "metrics.jsonl")
    assert (change["lost"], change["joined"], change["workers"]) == ([victim], [victim], 2)
    key = lambda r: (r["epoch"], r["valid_error"],  # noqa: E731
                     None if victim == 0 and r["epoch"] == change["epoch"] else r["loss"])
    assert [key(r) for r in epochs(out / "metrics.jsonl") if "event" not in r] == \
        [key(r) for r in epochs(tmp_path / "base" / "metrics.jsonl")]
    _nothing_left(procs, before)


def test_a_node_started_again_joins_the_run_and_takes_its_state(tmp_path):
    """2 nodes x 2 workers, --min-workers 2: node 1's launcher killed, node 0 goes on
    alone; node 1 started again with the same command joins (its workers take node 0's
    state across the data links), and both finish every epoch with status 0,
    bit-identical (the launcher compares the replicas); the record says who left and who
    joined."""
    port = free_port()
    out = tmp_path / "run"
    before = set(glob.glob("/dev/shm/pympgu-*"))
    argv = lambda k: node_argv(k, port, "--epochs", "300", "--min-workers", "2",  # noqa: E731
                               *(["--out", str(out)] if k == 0 else []))
    procs = [start(argv(k)) for k in range(2)]
    try:
        assert wait_until((out / "checkpoint.npz").exists, 120, every=0.05)
        os.kill(procs[1].pid, signal.SIGKILL)
        assert wait_until(lambda: len(_changes(out / "metrics.jsonl")) == 1, 60, every=0.05)
        procs.append(start(argv(1)))
        codes = [procs[0].wait(timeout=200), procs[2].wait(timeout=30)]
        errs = [procs[0].stderr.read(), procs[2].stderr.read()]
    finally:
        for p in procs:
            kill_session(p)
    assert codes == [0, 0], [e[-3000:] for e in errs]
    changes = _changes(out / "metrics.jsonl")
    assert [(c["lost"], c["joined"], c["workers"]) for c in changes] == \
        [([2, 3], [], 2), ([], [2, 3], 4)], changes
    assert "node 1 (" in errs[0] and ") joins the run; its workers start" in errs[0], errs[0]
    assert epochs(out / "metrics.jsonl")[-1]["epoch"] == 300
    _nothing_left(procs, before)


def test_a_node_lost_below_min_workers_stops_the_run(tmp_path):
    port = free_port()
    out = tmp_path / "run"
    procs = [start(node_argv(k, port, "--epochs", "100000", "--min-workers", "3",
                             *(["--out", str(out)] if k == 0 else []))) for k in range(2)]
    try:
        assert wait_until((out / "checkpoint.npz").exists, 120, every=0.2)
        os.kill(procs[1].pid, signal.SIGKILL)
        code0, err0 = procs[0].wait(timeout=60), procs[0].stderr.read()
    finally:
        for p in procs:
            kill_session(p)
    assert code0 == 1, err0[-3000:]
    assert ("2 worker(s) would remain without node 1, fewer than --min-workers 3: the run "
            "stops") in err0, err0[-3000:]


@pytest.mark.parametrize("victim", ["node 1's launcher", "node 0's launcher",
                                    "node 1's worker aborts as node 0's launcher dies",
                                    "a worker of node 1"])
def test_a_node_or_rank_lost_stops_every_node_within_seconds(tmp_path, victim):
    port = free_port()
    out = tmp_path / "run"
    before = set(glob.glob("/dev/shm/pympgu-*"))
    procs = [start(node_argv(k, port, "--epochs", "100000",
                             *(["--out", str(out)] if k == 0 else []))) for k in range(2)]
    try:
        assert wait_until((out / "checkpoint.npz").exists, 120, every=0.2), \
            "the run did not reach its first epoch"
        workers = [int(p) for p in subprocess.run(
            ["pgrep", "-f", "-s", str(procs[1].pid), "spawn_main"], capture_output=True,
            text=True).stdout.split()]
        assert workers, session_left(procs[1].pid)
        if victim == "a worker of node 1":
            os.kill(workers[-1], signal.SIGKILL)
            survivors = procs
        elif victim.endswith("dies"):
            # As a C++ runtime may abort a process whose peer's node vanished: the loss is
            # the cause, not the abort (sent first, so that it is the first failure node 1
            # sees).
            os.kill(workers[0], signal.SIGABRT)
            os.kill(procs[0].pid, signal.SIGKILL)
            survivors = [procs[1]]
        else:
            k = 1 if victim.startswith("node 1") else 0
            os.kill(procs[k].pid, signal.SIGKILL)
            survivors = [procs[1 - k]]
        t0 = time.monotonic()
        for p in survivors:
            p.wait(timeout=30)
        stopped = time.monotonic() - t0
        results = [(p.returncode, p.stderr.read()) for p in survivors]
    finally:
        for p in procs:
            kill_session(p)
    assert stopped < 10, f"the other node took {stopped:.1f} s to stop"
    for code, err in results:
        assert code == 1, err[-3000:]
        assert "training failed" in err
    err = results[0][1]
    if victim == "node 1's launcher":
        assert "node 1 (" in err and "stopped answering: its launcher is gone" in err, err
    elif victim == "node 0's launcher":
        assert f"node 0 at 127.0.0.1:{port} stopped answering: its launcher is gone" \
            in err, err
    elif victim.endswith("dies"):
        assert f"node 0 at 127.0.0.1:{port} stopped answering: its launcher is gone; " \
            f"then rank 2 was killed by signal {int(signal.SIGABRT)}" in err, err
    else:
        assert "was killed by signal 9" in err and "(node 1)" in err, err
        assert f"continue with --resume {out}" in err
    _nothing_left(procs, before)


def test_a_node_without_the_secret_is_refused_and_the_run_goes_on(tmp_path):
    port = free_port()
    impostor = start(node_argv(1, port, "--epochs", "2"), secret="not the run's secret at all")
    time.sleep(1.0)
    procs = [start(node_argv(k, port, "--epochs", "2")) for k in range(2)]
    try:
        (code0, out0, err0), (code1, _, err1) = finish(procs)
        (code, _, err), = finish([impostor], timeout=30)
    finally:
        kill_session(impostor)
    assert code0 == 0 and code1 == 0, err0[-2000:] + err1[-2000:]
    assert "dropped" in err0 and "had not shown the nodes' secret" in err0, err0
    assert "epoch   2" in out0
    assert code == 1 and "answers under another secret" in err, err[-2000:]


def test_half_precision_wires_stay_on_one_node_and_nccl_on_gpus():
    from pympgu.training.config import RunConfig, UsageError
    assert RunConfig(devices=(0, 1), nnodes=2).nworkers == 4
    with pytest.raises(UsageError, match="across nodes the exchange is float32") as info:
        RunConfig(nnodes=2, exchange_dtype="bfloat16")
    assert info.value.flag == "--exchange-dtype"
    with pytest.raises(UsageError, match="nccl: NCCL averages GPU workers") as info:
        RunConfig(nnodes=2, method="nccl")
    assert info.value.flag == "--method"
    with pytest.raises(UsageError, match="--method nccl averages float32") as info:
        RunConfig(devices=(0, 1), method="nccl", exchange_dtype="float16")
    assert info.value.flag == "--exchange-dtype"
    assert RunConfig(nnodes=3, devices=(None, None)).nworkers == 6


@pytest.mark.parametrize("node", [0, 1])
def test_a_node_alone_says_which_is_missing(node):
    """Node 0 without node 1, or node 1 without node 0: named once the join time is up."""
    from pympgu.runtime import WorkerFailed, launch
    from runtime_targets import average_rounds
    where = nodes.Nodes(2, node, "127.0.0.1", free_port())
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        launch(average_rounds, (1,), cpu=1, nodes=where, secret=SECRET.encode(),
               join_timeout=2.0)
    assert time.monotonic() - t0 < 20
    if node == 0:
        assert "node(s) [1] did not join within 2 s at 127.0.0.1:" in str(info.value)
    else:
        assert f"node 0 did not answer at {where.address} within 2 s" in str(info.value)


def test_slurms_first_host_comes_from_scontrol_where_it_is_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: the list read here
    assert nodes.first_host("gpu[03-05,9],cpu1") == "gpu03"
    assert nodes.first_host("node7") == "node7"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'a-b\\nc\\n'\n")
    scontrol.chmod(0o755)
    assert nodes.first_host("a-[b,c]") == "a-b"  # Slurm's expansion, whatever the list says
