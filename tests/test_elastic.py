"""Training that goes on without a lost worker (--min-workers), on CPU workers: a worker
killed at each moment of a run, the survivors identical after it, nothing left behind, and
the run stopped where too few would remain."""
import glob
import os

import numpy as np
import pytest

from pympgu.runtime import WorkerFailed, launch
from pympgu.training import RunConfig
from pympgu.training import checkpoint
from elastic_targets import dying_worker
from processes import alive
from runtime_targets import shm_left

pytestmark = pytest.mark.timeout(180)

# A small run: the embedded MNIST, a narrow MLP, 3 epochs of 3 workers.
CONFIG = dict(devices=(None, None, None), hidden=(64,), epochs=3, batch_size=100,
              min_workers=1)


def train(tmp_path, faults, launching=None, pace=0.0, **changes):
    """Launch the run with ``faults`` ({rank: (phase, k)}); returns (survivors' results,
    membership records, pids)."""
    cfg = RunConfig(**{**CONFIG, **changes})
    records = []
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir(exist_ok=True)

    def on_metric(rank, data):
        if data.get("kind") in ("membership", "epoch"):
            records.append(dict(data))
    try:
        results = launch(dying_worker, (cfg, faults, str(pid_dir), pace), cpu=len(cfg.devices),
                         on_metric=on_metric, min_workers=cfg.min_workers,
                         **(launching or {}))
    finally:
        pids = [int(open(p).read()) for p in glob.glob(str(pid_dir / "*.pid"))]
        assert not [p for p in pids if alive(p)], "a worker outlived the run"
    return results, records, pids


def check_survivors(results, records, lost, phase):
    """Every survivor ended with the same bits, the loss was told once, and training went on
    to a sane model; nothing of the run is left in /dev/shm."""
    assert len(results) == 3 - len(lost), (phase, results)
    assert len({r["digest"] for r in results}) == 1, (phase, [r["digest"] for r in results])
    changes = [r for r in records if r.get("event") == "membership"]
    assert [c["lost"] for c in changes] == [[r] for r in lost], (phase, changes)
    for c in changes:
        assert c["workers"] >= 1 and c["from_step"] <= c["at_step"] and c["seconds"] >= 0
        assert "killed by signal 9" in c["reason"]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3], (phase, epochs)
    assert results[0]["history"][-1]["test_error"] < 0.2, results[0]["history"]
    assert not shm_left(results[0]["run_id"])


@pytest.mark.parametrize("phase,k", [("step", 30), ("exchange", 30), ("epoch", 1)])
@pytest.mark.parametrize("rank", [0, 2])
def test_a_run_goes_on_without_a_worker_killed(tmp_path, phase, k, rank):
    """Killed while computing, inside an exchange half done, or at the epoch's barrier:
    rank 0 (who evaluates and saves) or another."""
    results, records, _ = train(tmp_path, {rank: (phase, k)})
    check_survivors(results, records, [rank], phase)


def test_a_hung_worker_is_killed_and_the_others_go_on(tmp_path):
    results, records, _ = train(tmp_path, {1: ("hang", 30)}, dict(progress_timeout=3))
    changes = [r for r in records if r.get("event") == "membership"]
    assert len(changes) == 1 and "reached no barrier in 3 s" in changes[0]["reason"], changes
    assert changes[0]["seconds"] < 3, changes
    assert len(results) == 2 and len({r["digest"] for r in results}) == 1


def test_a_worker_killed_while_the_checkpoint_is_written(tmp_path):
    """Rank 0 dies with its checkpoint written but not in place: the checkpoint on disk is
    the previous epoch's, whole; the new rank 0 writes the epoch's again, and the run's
    log holds every epoch once and the loss."""
    out = tmp_path / "out"
    out.mkdir()
    results, records, _ = train(tmp_path, {0: ("checkpoint", 2)}, out=str(out))
    check_survivors(results, records, [0], "checkpoint")
    model_epoch, history, values = checkpoint.read(str(out / checkpoint.CHECKPOINT),
                                                   _model())
    assert model_epoch == 3 and [h["epoch"] for h in history] == [1, 2, 3]
    assert all(np.isfinite(v).all() for v in values)
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_two_workers_lost_one_after_the_other(tmp_path):
    results, records, _ = train(tmp_path, {1: ("step", 20), 2: ("exchange", 60)})
    check_survivors(results, records, [1, 1], "two")  # rank 2 is rank 1 once 1 is lost


def test_below_min_workers_the_run_stops(tmp_path):
    with pytest.raises(WorkerFailed) as info:
        train(tmp_path, {1: ("step", 20), 2: ("step", 60)}, min_workers=2)
    assert "fewer than --min-workers 2" in str(info.value), info.value
    assert "killed by signal 9" in str(info.value)


@pytest.mark.parametrize("phase", ["build", "setup"])
def test_a_worker_lost_before_the_first_exchange_stops_the_run(tmp_path, phase):
    with pytest.raises(WorkerFailed) as info:
        train(tmp_path, {1: (phase, 1)})
    assert "before the workers' first exchange" in str(info.value), info.value


def test_without_min_workers_a_loss_stops_the_run_as_before(tmp_path):
    with pytest.raises(WorkerFailed) as info:
        train(tmp_path, {2: ("step", 10)}, min_workers=None)
    assert "rank 2 was killed by signal 9" in str(info.value)
    assert "min-workers" not in str(info.value)


def _model():
    from pympgu import data
    from pympgu.training.replica import build_model
    cfg = RunConfig(**CONFIG)
    return build_model(cfg, data.load(cfg.data))


@pytest.mark.parametrize("changes,message", [
    (dict(devices=(0, 1)), "only across nodes that meet every H steps"),
    (dict(devices=(0, 1), nnodes=2), "only across nodes that meet every H steps"),
    (dict(devices=(0, 1), nnodes=2, restart_workers=1),
     "only across nodes that meet every H steps"),
])
def test_what_cannot_go_on_without_a_worker_yet_is_refused(changes, message):
    from pympgu.training.config import UsageError
    with pytest.raises(UsageError) as info:
        RunConfig(**{**CONFIG, **changes})
    assert message in str(info.value)


def test_gpu_workers_across_nodes_that_meet_every_h_steps_may_be_restarted():
    cfg = RunConfig(**{**CONFIG, "devices": (0, 1), "nnodes": 2, "min_workers": 2,
                       "across_nodes": "diloco", "restart_workers": 3})
    assert cfg.restart_workers == 3


def test_launch_goes_on_without_a_gpu_worker_only_across_nodes():
    """A GPU worker lost inside a node leaves its peers' kernels waiting: launch refuses
    min_workers for GPU workers of one node before any process starts."""
    with pytest.raises(ValueError, match="only across nodes"):
        launch(dying_worker, gpus=[0, 1], min_workers=1)


class _Proc:
    """A worker process as the coordinator sees it."""

    def __init__(self, exitcode=None):
        self.exitcode, self.killed, self.pid = exitcode, False, 1

    def kill(self):
        self.killed, self.exitcode = True, -9

    def join(self, timeout=None):
        pass


class _Listener:
    socket = None

    def __init__(self):
        self.sent, self.forgotten = [], []

    def broadcast(self, kind, data, blobs=(), ranks=None):
        self.sent.append((kind, data, ranks))

    def send(self, rank, kind, data=None):
        self.sent.append((kind, data, [rank]))

    def forget(self, rank):
        self.forgotten.append(rank)


class _Above:
    sockets = ()

    def __init__(self):
        self.paused, self.held = [], []

    def attach(self, coordinator):
        pass

    def pause(self, rank, reason, joined):
        self.paused.append((rank, reason, joined))

    def hold(self, data):
        self.held.append(data)


# (whole, what each new worker took up of its predecessor's: the positions it kept)
@pytest.mark.parametrize("whole,took", [
    (True, [[], []]), (True, [[[0, 6, 12], [0, 8, 16]], [[0, 8, 16]]]), (False, None)],
    ids=["gpu-nothing-kept", "gpu-kept", "cpu"])
def test_a_gpu_nodes_lost_worker_is_restarted_with_its_peers(whole, took):
    """Across nodes with restarts, node 1's worker in slot 1 dies. GPU workers (whole):
    its peer, whose kernels would wait for it, is killed too, both slots start again as
    one restart, and once both new workers are ready the node holds what they took up
    from their predecessors (every worker keeps its state where its successor finds it),
    or, where they kept nothing, nothing; CPU workers: the lost slot alone starts again,
    and the peer stays."""
    from pympgu.runtime.coordinator import NodeCoordinator
    first = [_Proc(), _Proc(exitcode=-9)]
    procs, started = list(first), []

    def start(slot, joining=False):
        started.append((slot, joining))
        return _Proc(), []
    listener, above = _Listener(), _Above()
    c = NodeCoordinator(listener, procs, [[], []], node=1, nnodes=2, above=above,
                        on_metric=None, log=lambda text: None, heartbeat_timeout=60,
                        progress_timeout=60, restarting=(start, 2, [], whole))
    c.running = True
    c._lose(1, WorkerFailed(3, "was killed by signal 9", node=1), now=0.0)
    assert first[0].killed is whole
    assert started == ([(0, True), (1, True)] if whole else [(1, True)])
    assert c.restarts == 1
    assert above.paused == [(3, "rank 3 was killed by signal 9 (node 1)",
                             [2, 3] if whole else [3])]
    assert c.membership.members == ([] if whole else [0])
    if not whole:
        return
    for slot in (0, 1):
        c._from_worker(slot, "HELLO", {}, [])
        assert listener.sent[-1] == ("RUN", {"joining": True, "carry": True}, [slot])
    c._from_worker(0, "RECOVER", {"kept": took[0], "at": None}, [])
    assert above.held == []  # (its peer is not ready yet)
    c._from_worker(1, "RECOVER", {"kept": took[1], "at": None}, [])
    if not took[0]:
        assert [h["kept"] for h in above.held] == [[]]  # (the hub has it take another's)
        c.regroup({"nodes": [0, 1], "back_to": [0, 6, 12], "source": 0, "keeper": 0})
    else:  # the newest both hold, its step with it; no worker takes another's state
        assert [h["kept"] for h in above.held] == [[[0, 8, 16]]]
        c.regroup({"nodes": [0, 1], "back_to": [0, 8, 16], "source": None, "keeper": 0})
    kind, reform, ranks = listener.sent[-1]
    assert (kind, ranks, reform["members"], reform["root"]) == ("REFORM", [0, 1], [0, 1], None)
    assert reform["source"] == (None if took[0] else 0)
    record = c.membership.record(now=1.0)
    assert (record["lost"], record["joined"], record["workers"]) == ([3], [0, 1], 4)


def test_the_command_goes_on_without_a_killed_worker(tmp_path):
    """python -m pympgu.train --min-workers: a worker killed from outside, the run ends with
    status 0, says what happened in one line, and its log records it."""
    import json
    import signal
    import sys
    from processes import kill_session, session_left, start, wait_until
    out = tmp_path / "run"
    proc = start([sys.executable, "-m", "pympgu.train", "--cpu", "3", "--min-workers", "2",
                  "--epochs", "6", "--batch-size", "32", "--hidden", "256", "--out", str(out)])
    try:
        assert wait_until(lambda: (out / "metrics.jsonl").exists() or proc.poll() is not None,
                          150)
        workers = [int(c) for c in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read()
                   .split() if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
        assert len(workers) == 3, workers
        os.kill(workers[1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        kill_session(proc)
    assert proc.returncode == 0, stderr
    assert "rank 1 lost (was killed by signal 9" in stderr and "2 workers go on" in stderr
    records = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [r["lost"] for r in records if r.get("event") == "membership"] == [[1]]
    assert [r["epoch"] for r in records if "event" not in r] == [1, 2, 3, 4, 5, 6]
    assert wait_until(lambda: not session_left(proc.pid), 5), session_left(proc.pid)


def test_the_survivors_go_back_to_the_newest_state_all_of_them_hold():
    """One survivor passed the exchange's second barrier, another did not: both hold the
    state before it, which is where they go back to; ranks are renumbered in slot order."""
    from pympgu.runtime.membership import Membership
    m = Membership(4, min_workers=2)
    lost = WorkerFailed(1, "was killed by signal 9 (pid 7)")
    assert m.lose(1, lost, now=0.0) == {"lost": 1, "reason": lost.reason}
    assert m.members == [0, 2, 3] and m.rank(3) == 2
    assert m.heard(2, "BARRIER") is False and m.heard(2, "RECOVER") is True
    assert m.recovered(0, [[0, 8, 2], [0, 12, 3]], [0, 12, 3]) is None
    assert m.heard(0, "BARRIER") is True and m.heard(1, "METRIC") is False
    assert m.recovered(2, [[0, 4, 1], [0, 8, 2]], [0, 8, 2]) is None
    reform = m.recovered(3, [[0, 4, 1], [0, 8, 2]], [0, 8, 2])
    assert reform == {"members": [0, 2, 3], "back_to": [0, 8, 2], "root": None, "node": 0,
                      "nnodes": 1, "source": None, "keeper": None}
    record = m.record(now=1.5)
    assert (record["lost"], record["at_step"], record["from_step"], record["workers"],
            record["seconds"]) == ([1], 4, 3, 3, 1.5)
    assert m.record() is None  # told once
    with pytest.raises(WorkerFailed, match="fewer than --min-workers 2"):
        m.lose(0, WorkerFailed(0, "exited with status 1"), now=2.0)
        m.lose(2, WorkerFailed(1, "exited with status 1"), now=2.0)


def test_survivors_without_a_state_in_common_stop_the_run():
    from pympgu.runtime.membership import Membership
    m = Membership(3, min_workers=1)
    m.lose(2, WorkerFailed(2, "was killed by signal 9"), now=0.0)
    m.recovered(0, [], None)
    with pytest.raises(WorkerFailed, match="before the workers' first exchange"):
        m.recovered(1, [[0, 0, 0]], None)


@pytest.mark.parametrize("rank", [0, 2])
def test_a_restarted_worker_joins_with_the_others_state(tmp_path, rank):
    """--restart-workers: a new process takes the lost one's place, joins once it is ready
    (the others go back to their last exchange), takes its state from a peer, and from
    then on is bit-identical to the others; as rank 0 it goes on evaluating and saving."""
    results, records, _ = train(tmp_path, {rank: ("step", 30)}, dict(restarts=1),
                                pace=0.02, epochs=6)
    changes = [r for r in records if r.get("event") == "membership"]
    assert [(c["lost"], c["joined"]) for c in changes] == [([rank], []), ([], [rank])]
    assert len(results) == 3 and len({r["digest"] for r in results}) == 1
    epochs = [r for r in records if r.get("kind") == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(e["loss"]) for e in epochs)
    assert not shm_left(results[0]["run_id"])


def test_a_joiner_holds_nothing_until_an_exchange_with_the_others():
    """A loss while a restarted worker is being taken in: its state is still no one's, so
    the others' newest common exchange is the way back, and it takes its state again."""
    from pympgu.runtime.membership import Membership
    m = Membership(3, min_workers=1)
    m.lose(1, WorkerFailed(1, "was killed by signal 9"), now=0.0)
    for slot in (0, 2):
        m.recovered(slot, [[0, 6, 2]], None)
    m.record()
    m.grow([1], now=1.0)
    m.recovered(0, [[0, 6, 2], [0, 8, 3]], None)
    assert m.recovered(2, [[0, 6, 2], [0, 8, 3]], None)["root"] == 0
    assert m.members == [0, 1, 2] and m.fresh == {1}
    m.lose(2, WorkerFailed(2, "was killed by signal 9"), now=2.0)  # before the welcome: rank 0
    # alone holds the state, and the way back is its newest
    m.recovered(1, [[0, 8, 3]], None)  # what it says is not taken: it holds nothing yet
    reform = m.recovered(0, [[0, 8, 3], [0, 10, 4]], None)
    assert reform == {"members": [0, 1], "back_to": [0, 10, 4], "root": 0, "node": 0,
                      "nnodes": 1, "source": None, "keeper": None}
    m.record()
    assert not m.fresh


def test_a_worker_killed_while_a_restarted_one_joins(tmp_path):
    """Rank 1 dies as the restarted rank 2 takes its state: the joiner holds nothing of the
    run yet, so it takes its state again, from rank 0, and the two go on identical."""
    results, records, _ = train(tmp_path, {2: ("step", 30), 1: ("welcome", 1)},
                                dict(restarts=1), pace=0.02, epochs=6)
    changes = [r for r in records if r.get("event") == "membership"]
    assert [r for c in changes for r in c["lost"]] == [2, 1], changes
    assert changes[-1]["joined"] == [1] and changes[-1]["workers"] == 2, changes
    assert len(results) == 2 and len({r["digest"] for r in results}) == 1
    assert [e["epoch"] for e in records if e.get("kind") == "epoch"] == [1, 2, 3, 4, 5, 6]


def test_a_worker_keeps_its_state_where_its_successor_takes_it_up(tmp_path):
    """Each kept point is written once (a file), then the slot's index naming the points
    kept and the history; the next worker in the slot reads exactly those, and what its
    predecessor left half written, or no longer named, goes. Other slots' files stay."""
    from pympgu.training.carried import Carried
    where = str(tmp_path / "kept")
    a, b, c = [([0, k, k], [np.full(3, k, np.float32)], {"costs": [k]}, None) for k in (1, 2, 3)]
    first, other = Carried(where, 0), Carried(where, 1)
    first.write([a], {"history": []})
    other.write([a], {"history": []})
    first.write([a, b], {"history": [{"epoch": 1}]})
    assert len([n for n in os.listdir(where) if n.startswith("slot0-")]) == 2  # (a's once)
    first.write([b, c], {"history": [{"epoch": 1}]})
    open(os.path.join(where, "slot0-1-9.tmp"), "wb").write(b"torn")  # (killed mid-write)
    entries, extra = Carried(where, 0).read()
    assert [e[0] for e in entries] == [[0, 2, 2], [0, 3, 3]]
    assert [e[1][0].tolist() for e in entries] == [[2.0] * 3, [3.0] * 3]
    assert (entries[1][2], extra) == ({"costs": [3]}, {"history": [{"epoch": 1}]})
    left = sorted(os.listdir(where))
    assert len([n for n in left if n.startswith("slot0-")]) == 2 and "slot0" in left
    assert "slot1" in left and len([n for n in left if n.startswith("slot1-")]) == 1
    assert Carried(str(tmp_path / "none"), 0).read() is None


def test_a_node_told_the_run_ended_finishes_with_the_results_it_has():
    """Node 1's worker in slot 1 died after the run's last barrier and node 0's hub said
    the run is over (END): the node restarts nothing, lets go of a survivor that would
    recover (STOP), and finishes once its other worker's result is in, with that alone."""
    from pympgu.runtime.coordinator import NodeCoordinator
    procs = [_Proc(), _Proc(exitcode=-9)]
    listener, above = _Listener(), _Above()
    above.done = lambda: True
    c = NodeCoordinator(listener, procs, [[], []], node=1, nnodes=2, above=above,
                        on_metric=None, log=lambda text: None, heartbeat_timeout=60,
                        progress_timeout=60, restarting=(None, 2, [], True))
    c.running = True
    c.end()
    c._lose(1, WorkerFailed(3, "was killed by signal 9", node=1), now=0.0)
    assert (above.paused, c.restarts, procs[0].killed) == ([], 2, False)
    assert not c._finished()
    c._from_worker(0, "RECOVER", {"kept": [], "at": None}, [])
    assert listener.sent[-1] == ("STOP", {"reason": "the run has ended"}, [0])
    c._from_worker(0, "DONE", {"result": {"rank": 2}}, [])
    assert c._finished()


def test_a_worker_that_cannot_keep_its_state_trains_on_and_leaves_none(tmp_path,
                                                                       monkeypatch, capsys):
    """A full disk under the kept files: the worker says so once, removes what it kept and
    goes on keeping its points in memory; a successor that cannot read what its predecessor
    kept joins holding nothing (it will take another node's state)."""
    from types import SimpleNamespace
    from pympgu.training import carried
    from pympgu.training.recovery import Recovery
    where = tmp_path / "kept"
    ctx = SimpleNamespace(carry=str(where), link=SimpleNamespace(rank=0), rank=0,
                          is_cpu=True, local_rank=0, joining=False)
    rep = SimpleNamespace(values=lambda: [np.zeros(2, np.float32)], jax=None)
    recovery = Recovery(ctx, rep, True)
    recovery.keep([0, 1, 1])
    assert "slot0" in os.listdir(where)

    def full(path, value):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(carried, "_write", full)
    recovery.keep([0, 2, 2])
    assert recovery.carried is None and os.listdir(where) == []
    assert [e[0] for e in recovery.kept] == [[0, 1, 1], [0, 2, 2]]
    said = capsys.readouterr().err
    assert "its state could not be kept" in said and "No space left" in said
    (where / "slot0").write_bytes(b"not a pickle")
    ctx.joining = True
    assert Recovery(ctx, rep, True).take_up() is None and ctx.joining
    assert "could not be read" in capsys.readouterr().err and os.listdir(where) == []


@pytest.mark.parametrize("restarts", [0, 2])
def test_with_restarts_new_workers_compile_from_the_runs_own_cache(tmp_path, monkeypatch,
                                                                   restarts):
    """--restart-workers: a CPU worker's compiled programs go to a cache in the run's
    private directory (its temporary directory), which the worker started in a lost one's
    place reads; without restarts nothing is cached, nor for GPU workers."""
    import tempfile
    from types import SimpleNamespace
    from pympgu.training.worker import setup_backend
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr("pympgu.runtime.cores.pin", lambda n, r: None)  # (this process's)
    setup_backend(SimpleNamespace(device=0, nranks=1, rank=0), "jax", restarts)
    assert "JAX_COMPILATION_CACHE_DIR" not in os.environ  # (GPU workers: not measured)
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", ""))
    setup_backend(SimpleNamespace(device=None, nranks=1, rank=0, local_nranks=1,
                                  local_rank=0), "jax", restarts)
    where = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    assert where == (str(tmp_path / "xla") if restarts else None)
