"""The control plane against a local process that knows everything but the run's secret, and
the launcher's end when it is killed: nothing injected, hung, stopped, crashed, poisoned or
written; nothing left running or in /dev/shm."""
import glob
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from pympgu.runtime import control, protocol, shm
from pympgu.runtime import WorkerFailed, launch
from processes import alive, communicate_all, free_port, kill_session, start, wait_until
from runtime_targets import average_rounds, hold_segment, shm_left

pytestmark = pytest.mark.timeout(240)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# The message format, and the coordinator's checks one by one.

SECRET = bytes(range(32))


def coordinator():
    return control.Listener(2, f"ipc://{tempfile.mkdtemp()}/c", secret=SECRET)


def hello(rank=1, seq=1, secret=SECRET, **payload):
    data = {"version": protocol.PROTOCOL_VERSION, "pid": 7, "device": None}
    data.update(payload)
    return protocol.seal(secret, b"C", "HELLO", rank, seq, data)


def test_only_the_secret_opens_a_message():
    frames = hello()
    assert protocol.unseal(SECRET, b"C", frames, protocol.TO_COORDINATOR, 2)[:3] == ("HELLO", 1, 1)
    with pytest.raises(protocol.Rejected, match="not authenticated"):
        protocol.unseal(bytes(32), b"C", frames, protocol.TO_COORDINATOR, 2)
    with pytest.raises(protocol.Rejected, match="not authenticated"):  # the other direction
        protocol.unseal(SECRET, b"W", frames, protocol.TO_COORDINATOR, 2)
    for i in range(len(frames)):
        tampered = list(frames)
        tampered[i] = tampered[i] + b" "
        with pytest.raises(protocol.Rejected, match="not authenticated"):
            protocol.unseal(SECRET, b"C", tampered, protocol.TO_COORDINATOR, 2)
    # Frames moved between one another keep their bytes but not their MAC.
    moved = [frames[0] + frames[1][:1], frames[1][1:], frames[2]]
    with pytest.raises(protocol.Rejected, match="not authenticated"):
        protocol.unseal(SECRET, b"C", moved, protocol.TO_COORDINATOR, 2)


@pytest.mark.parametrize("kind,payload,blobs,reason", [
    ("HELLO", {"version": 2, "pid": "7", "device": None}, (), "'pid' is a str"),
    ("HELLO", {"version": 2, "pid": 7}, (), "has no 'device'"),
    ("HELLO", {"version": 2, "pid": 7, "device": None, "x": 1}, (), "unknown fields"),
    ("METRIC", [1, 2], (), "not an object"),
    ("ERROR", {"traceback": 5}, (), "'traceback' is a int"),
    ("REGISTER", {"layout": [["w", [2], "float32"]], "facts": {}}, (b"a", b"b"), "2 blobs"),
    ("REGISTER", {"layout": [["w", "2", "float32"]], "facts": {}}, (b"a",), "not a list of"),
    ("RUN", {}, (), "unknown message type"),
])
def test_payloads_are_checked_against_their_schema(kind, payload, blobs, reason):
    frames = protocol.seal(SECRET, b"C", kind, 0, 1, payload, blobs)
    with pytest.raises(protocol.Rejected, match=reason):
        protocol.unseal(SECRET, b"C", frames, protocol.TO_COORDINATOR, 2)


@pytest.mark.parametrize("frames,reason", [
    ([b"REGISTER 0 1", b"{}", *[b"x" * (1 << 20)] * 3, b"m" * 32], "REGISTER with 3 blobs"),
    ([b"REGISTER 0 1", b"{}", b"x" * (1 << 20), b"m" * 32], "a blob above 4096 bytes"),
    ([b"METRIC 0 1", b"x" * (2 << 20), b"m" * 32], "METRIC of 2097162 bytes, above the 1048576"),
    ([b"HEARTBEAT 0 1", b" " * 5000, b"m" * 32], "HEARTBEAT of 5013 bytes, above the 4096"),
    ([b"X" * 100, b"{}", b"m" * 32], "3 frames"),
    ([b"NOSUCH 0 1", b"{}", b"m" * 32], "unknown message type 'NOSUCH'"),
    ([b"HELLO 0 1", b"{}", *[b"x"] * 60, b"m" * 32], "63 frames")])
def test_a_message_beyond_what_its_kind_holds_is_refused_before_its_mac(monkeypatch, frames,
                                                                         reason):
    """ZMQ caps a frame, not a message: the kind's own limits are checked on the frames'
    lengths before anything is hashed, so that no sender makes a launcher hash or keep more
    than the kind needs."""
    hashed = []
    monkeypatch.setattr(protocol, "mac", lambda *a: hashed.append(a) or b"m" * 32)
    with pytest.raises(protocol.Rejected, match=reason):
        protocol.unseal(SECRET, b"C", frames, protocol.TO_COORDINATOR, 2)
    assert not hashed


def test_a_holder_of_the_key_is_refused_a_message_of_128_mib():
    import zmq
    c = control.Listener(2, f"ipc://{tempfile.mkdtemp()}/c", secret=SECRET)
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    try:
        d.connect(c.address)
        body = [b"REGISTER 0 1", b"{}", *[b"x" * (1 << 20)] * 128]
        d.send_multipart(body + [protocol.mac(SECRET, b"C", body)])
        t0 = time.monotonic()
        while not c.rejected and time.monotonic() - t0 < 30:
            assert c.receive(100) is None
        assert c.rejected == 1 and c._last_reason == "131 frames"
    finally:
        d.close(0)
        ctx.term()
        c.close()


def test_ranks_beyond_the_run_replays_and_second_hellos_are_refused():
    c = coordinator()
    try:
        assert c._accept([b"id1", *hello(rank=1)])[:2] == (1, "HELLO")
        for identity, frames, reason in [
                (b"id2", hello(rank=1, seq=2), "a second HELLO for rank 1"),
                (b"id2", hello(rank=2), "outside 0..1"),
                (b"id1", protocol.seal(SECRET, b"C", "METRIC", 1, 1, {}), "replayed"),
                (b"id2", protocol.seal(SECRET, b"C", "METRIC", 1, 5, {}), "did not say HELLO"),
                (b"id1", hello(rank=0, version=1), "speaks protocol 1")]:
            with pytest.raises(protocol.Rejected, match=reason):
                c._accept([identity, *frames])
        assert c._accept([b"id1", *protocol.seal(SECRET, b"C", "METRIC", 1, 2, {"a": 1})])[1:3] \
            == ("METRIC", {"a": 1})
        # Heartbeats come from a socket of their own, numbered on their own.
        assert c._accept([b"beat", *protocol.seal(SECRET, b"C", "HEARTBEAT", 1, 1, {})])
    finally:
        c.close()


def hub_and_link(secret=SECRET, link_secret=None):
    """Node 0's hub (a run of 2 nodes, its key fresh) and node 1's link to it."""
    hub = control.Listener(2, "tcp://127.0.0.1:0", secret=secret, kinds=protocol.TO_HUB,
                           hello="JOIN", fresh_key=True)
    link = control.Link(hub.address, link_secret or secret, 1, 2, kinds=protocol.TO_NODE,
                        watch_parent=False, fresh_key=True)
    return hub, link


def join(link):
    link.send("JOIN", {"version": protocol.PROTOCOL_VERSION, "pid": 7, "host": "n1",
                       "nlocal": 1})


def pump(hub, link, timeout=10):
    """Carry the knock and its answer; node 0's raw frames of the next message that is not
    a knock (the run's JOIN, as anyone on the network could record it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        link.read()
        if hub.socket.poll(50):
            frames = hub.socket.recv_multipart()
            if frames[1] != b"KNOCK":
                return frames
            hub._accept(frames)
    raise AssertionError("nothing came")


def test_between_nodes_each_run_has_a_key_of_its_own():
    """The nodes' secret serves many runs: a JOIN recorded in one is refused in the next,
    as are messages under the secret itself; a node that knocks learns the run's key."""
    hub, link = hub_and_link()
    try:
        join(link)  # held until the run's key is known
        recorded = pump(hub, link)
        assert hub._accept(recorded)[:2] == (1, "JOIN")
        assert not link.secret_mismatch
        hub.send(1, "START", {"gen": 0, "joining": False})
        assert link.receive("START", timeout=10) == ({"gen": 0, "joining": False}, [])
    finally:
        link.close()
        hub.close()
    again = control.Listener(2, "tcp://127.0.0.1:0", secret=SECRET, kinds=protocol.TO_HUB,
                             hello="JOIN", fresh_key=True)
    try:
        assert again.nonce != hub.nonce
        with pytest.raises(protocol.Rejected, match="not authenticated"):
            again._accept(recorded)
        under_the_secret = protocol.seal(SECRET, b"C", "JOIN", 1, 1, {
            "version": protocol.PROTOCOL_VERSION, "pid": 7, "host": "n1", "nlocal": 1})
        with pytest.raises(protocol.Rejected, match="not authenticated"):
            again._accept([recorded[0], *under_the_secret])
        assert 1 not in again.identities  # node 1's place is still free
        with pytest.raises(protocol.Rejected, match="malformed KNOCK"):
            again._accept([b"x", b"KNOCK", b"short"])
    finally:
        again.close()


def test_a_node_under_another_secret_is_told_and_node_0_refuses_it():
    """Its CURVE keys are not the ones node 0's secret gives: the handshake fails, the node
    says that node 0 holds another secret, and node 0 counts a dropped connection."""
    logs = []
    hub, link = hub_and_link(link_secret=bytes(32))
    hub.log = logs.append
    try:
        join(link)
        assert wait_until(lambda: link.secret_mismatch, 10)
        assert wait_until(lambda: hub.police() or hub.dropped >= 2, 10)
        assert hub.receive(100) is None and hub.rejected == 0  # no message got through
    finally:
        link.close()
        hub.close()
    assert "dropped" in logs[-1] and "had not shown the nodes' secret" in logs[-1], logs


def test_rejections_are_summed_up_not_printed_one_by_one():
    import zmq
    logs = []
    c = control.Listener(2, f"ipc://{tempfile.mkdtemp()}/c", secret=SECRET, log=logs.append)
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    try:
        d.setsockopt(zmq.LINGER, 0)
        d.connect(c.address)
        for k in range(2000):
            d.send_multipart(hello(rank=k % 2, secret=bytes(32)))
        t0 = time.monotonic()
        while c.rejected < 2000 and time.monotonic() - t0 < 30:
            assert c.receive(100) is None
        assert c.rejected == 2000
    finally:
        d.close()
        ctx.term()
        c.close()
    assert 1 <= len(logs) <= 2 + (time.monotonic() - t0) / control.REJECT_SUMMARY_S, logs
    assert "2000 in all" in logs[-1] and "not authenticated" in logs[-1]


def test_worker_text_reaches_the_terminal_without_control_characters():
    text = protocol.printable("line 1\n\tline 2 \x1b[2J\x1b]0;title\x07 \u202e done")
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert text.startswith("line 1\n\tline 2 \\x1b[2J") and text.endswith("\\u202e done")
    assert protocol.printable("x" * 50, limit=10) == "x" * 10 + "... (40 more characters)"


# Whole runs under attack.

def _attacked(tmp_path, run, seconds, target="runs", flood=0):
    """run() while tests/attacker.py throws everything it has at ``target``; returns
    run's value and the attacker's report."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    os.chmod(tmp_path, 0o755)
    before = hashlib.sha256(victim.read_bytes()).hexdigest(), victim.stat().st_mtime_ns
    attacker = subprocess.Popen([sys.executable, os.path.join(HERE, "attacker.py"), target,
                                 str(victim), str(seconds), "2", str(flood)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                    [ROOT, HERE, os.environ.get("PYTHONPATH", "")])))
    try:
        time.sleep(0.5)  # it is already watching when the run starts
        result = run()
        ended = time.time()
        out, err = attacker.communicate(timeout=seconds + 60)
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
    assert attacker.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report.get("phases_done_at", ended + 1) < ended, \
        "the run ended before the attacker had fuzzed, connected and sent its big message"
    after = hashlib.sha256(victim.read_bytes()).hexdigest(), victim.stat().st_mtime_ns
    assert after == before, "the run wrote into the attacker's victim"
    assert report["names_read"] == 0, "another user read the run's shared memory"
    return result, report


def test_another_user_cannot_reach_a_runs_control_socket(tmp_path):
    """Inside a node the control plane is a Unix socket in the run's private directory: a
    user without the secret finds the directory and gets no further, and the run hears
    nothing of it."""
    clean = launch(average_rounds, (400,), cpu=2)
    logs, metrics = [], []

    def run():
        return launch(average_rounds, (400, None, None, None, False, 0.02), cpu=2,
                      log=logs.append,
                      on_metric=lambda rank, data: metrics.append((rank, data)))

    results, report = _attacked(tmp_path, run, seconds=12)
    assert report["dirs_seen"] and report["ipc_connected"] == 0 and report["ipc_refused"] > 0
    assert report["forged"] > 1000 and report["fuzzed"] >= 10000
    assert len({r["digest"] for r in results}) == 1
    assert all(r["stats"]["exchanges"] == 400 for r in results)
    assert sorted(metrics, key=lambda m: (m[0], m[1]["round"])) == \
        [(r, {"round": k}) for r in range(2) for k in range(400)]
    assert results[0]["digest"] == clean[0]["digest"]
    assert not logs, logs  # not one message reached the launcher
    assert not shm_left(results[0]["run_id"])


def _fds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def test_a_flood_at_node_0s_port_leaves_the_run_as_a_clean_one(tmp_path):
    """Node 0's port (TCP) under forgeries, fuzz, a message of 128 MiB and 3,000 idle
    connections, from another user: none passes the CURVE handshake that the nodes' secret
    keys, the idle ones are dropped (at most MAX_PENDING wait at a time), node 0's launcher
    holds few descriptors, and the run ends as a clean one does, status 0."""
    port = free_port(pair=True, fixed=True)
    env = dict(os.environ, PYMPGU_SECRET="0f1e2d3c4b5a69788796a5b4c3d2e1f0")

    def two_nodes(out, watch=None):
        argv = [sys.executable, "-m", "pympgu.train", "--cpu", "1", "--hidden", "16",
                "--epochs", "30", "--quiet", "--nnodes", "2", "--coordinator",
                f"127.0.0.1:{port}", "--node-rank"]
        procs = [start(argv + ["0", "--out", str(out)], env), start(argv + ["1"], env)]
        most = 0
        while watch is not None and procs[0].poll() is None:
            most = max(most, _fds(procs[0].pid))
            time.sleep(0.05)
        (code0, _, err0), (code1, _, err1) = communicate_all(procs)
        assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
        assert "Traceback" not in err0 + err1
        learnt = [(x["epoch"], x["loss"], x["valid_error"])
                  for x in map(json.loads, open(out / "metrics.jsonl"))]
        return learnt, most, err0

    clean, usual, _ = two_nodes(tmp_path / "clean", watch=True)
    (learnt, most, err0), report = _attacked(
        tmp_path, lambda: two_nodes(tmp_path / "attacked", watch=True), seconds=10,
        target=f"tcp://127.0.0.1:{port}", flood=3000)
    assert learnt == clean
    # The flood came (how many the attacker opens in its 10 s depends on the CPU the run
    # leaves it: 705 to 3,000 here), and node 0 held at most half of it at a time.
    assert report["flood"] >= 500, report
    assert most < usual + report["flood"] / 2, (most, usual, report["flood"])
    assert "had not shown the nodes' secret" in err0 and "rejected" not in err0, err0


def test_shared_memory_is_private_and_its_names_say_nothing(tmp_path):
    results = launch(hold_segment, (str(tmp_path), 0.0), cpu=2)
    for r in results:
        name, mode, uid = r["name"], r["mode"], r["uid"]
        assert stat.S_IMODE(mode) == 0o600 and uid == os.geteuid()
        assert shm.NAME.fullmatch(name) and f"-{r['rank']}-" in name
    assert results[0]["name"].split("-")[1] == results[1]["name"].split("-")[1]
    # A peer's name of any other form is refused before anything is opened.
    for bad in ["/etc/passwd", "../etc/passwd", "pympgu-ab-1/../../etc/passwd",
                results[1]["name"].replace("-1-", "-0-")]:
        with pytest.raises(ValueError, match="refused"):
            shm.Segment(bad, 16, create=False, prefix=shm.segment_name(
                results[1]["name"].split("-")[1], 1))


def test_a_name_of_the_run_that_is_a_link_or_someone_elses_file_is_refused(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"\0" * 4096)
    link = os.path.join(shm.SHM_DIR, "pympgu-5eed-1-abcdef")
    os.symlink(target, link)
    try:
        with pytest.raises(OSError):
            shm.Segment("pympgu-5eed-1-abcdef", 16, create=False, prefix="pympgu-5eed-1")
    finally:
        os.unlink(link)
    path = os.path.join(shm.SHM_DIR, "pympgu-5eed-1-abcdee")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    os.ftruncate(fd, 4096)
    os.close(fd)
    os.chmod(path, 0o644)
    try:
        with pytest.raises(PermissionError, match="not a private file"):
            shm.Segment("pympgu-5eed-1-abcdee", 16, create=False, prefix="pympgu-5eed-1")
    finally:
        os.unlink(path)


# The hang check, and the launcher killed.

def test_a_rank_that_heartbeats_but_never_arrives_fails_the_run():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        launch(average_rounds, (50, None, (1, 3, "hang")), cpu=2, progress_timeout=3.0,
               heartbeat_timeout=60.0)
    assert info.value.rank == 1
    assert "reached no barrier in 3 s while rank(s) [0] waited" in str(info.value)
    assert time.monotonic() - t0 < 30


LAUNCHER = ("import sys; sys.path.insert(0, {tests!r});"
            "from pympgu.runtime import launch; from runtime_targets import hold_segment;"
            "launch(hold_segment, ({pids!r}, 3600.0, {unlink}), cpu=3)")


@pytest.mark.parametrize("sig,unlinked", [(signal.SIGKILL, False), (signal.SIGKILL, True),
                                          (signal.SIGTERM, False)])
def test_the_launcher_killed_leaves_no_process_and_no_shared_memory(tmp_path, sig, unlinked):
    """Each rank holds a segment (before its name is unlinked, or after), and the launcher
    is killed: the workers go within seconds and take every name with them."""
    script = LAUNCHER.format(tests=HERE, pids=str(tmp_path), unlink=unlinked)
    proc = start([sys.executable, "-c", script])
    try:
        assert wait_until(lambda: len(glob.glob(str(tmp_path / "*.ready"))) == 3, 60)
        pids = [int(open(p).read()) for p in glob.glob(str(tmp_path / "*.pid"))]
        run_id = (tmp_path / "run_id").read_text()
        assert len(shm_left(run_id)) == (0 if unlinked else 3)
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=30)
    finally:
        kill_session(proc)
    assert wait_until(lambda: not [p for p in pids if alive(p)], 10), \
        "a worker outlived its launcher"
    assert not shm_left(run_id)
    if sig == signal.SIGTERM:
        assert "Terminated" in err  # stopped as Ctrl-C stops it, not killed
        assert proc.returncode != -signal.SIGTERM
