"""The runtime on CPU workers: exchange, failures, bad input, concurrent runs."""
import errno
import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from pympgu.runtime import WorkerFailed, launch
from processes import alive, kill_session, start, wait_until
from runtime_targets import (attack_then_average, average_rounds, part_rounds, results_outlive,
                             shared_rounds, shm_left, wire_rounds)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("nworkers", [1, 2, 3, 4, 8])
def test_cpu_workers_average_exactly(nworkers):
    metrics = []
    results = launch(average_rounds, (3,), cpu=nworkers,
                     on_metric=lambda rank, data: metrics.append((rank, data["round"])))
    assert len({r["digest"] for r in results}) == 1
    assert all(r["stats"]["exchanges"] == 3 for r in results)
    assert sorted(metrics) == sorted((r, k) for r in range(nworkers) for k in range(3))
    assert not shm_left(results[0]["run_id"])


@pytest.mark.parametrize("nworkers", [1, 3])
def test_a_result_stays_until_the_exchange_after_next_and_outlives_the_exchanger(nworkers):
    run_ids = launch(results_outlive, (4,), cpu=nworkers)
    assert not shm_left(run_ids[0])


def test_a_barrier_gives_every_rank_rank_0s_shared_value():
    results = launch(shared_rounds, (3,), cpu=3)
    assert results == [[{"rank": 0, "round": k} for k in range(3)]] * 3


def test_cpu_workers_average_one_packed_array():
    """start(flat=True): one array laid out at the Exchanger's offsets, as JAX workers send."""
    results = launch(average_rounds, (3, None, None, None, True), cpu=3)
    assert len({r["digest"] for r in results}) == 1
    assert all(r["stats"]["exchanges"] == 3 for r in results)


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_failing_worker_stops_the_run(tmp_path, how):
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        launch(average_rounds, (50, str(tmp_path), (1, 2, how)), cpu=3)
    assert time.monotonic() - t0 < 10
    err = info.value
    assert err.rank == 1
    assert "rank 1" in str(err)
    if how == "kill":
        assert "signal 9" in str(err)
    else:
        assert "boom at round 2" in err.details
    pids = [int(open(p).read()) for p in glob.glob(str(tmp_path / "*.pid"))]
    assert len(pids) == 3
    assert not [p for p in pids if alive(p)], "a worker outlived the run"
    assert not shm_left((tmp_path / "run_id").read_text())


def test_layout_mismatch_is_a_clear_error():
    with pytest.raises(WorkerFailed) as info:
        launch(average_rounds, (1, None, None, "mismatch"), cpu=2)
    text = str(info.value)
    assert "different parameter layout" in text
    assert "b2 (5,) float32" in text and "b2 (6,) float32" in text


def test_garbage_is_rejected_and_the_run_goes_on():
    logs = []
    results = launch(attack_then_average, (20,), cpu=2, log=logs.append)
    assert len({r["digest"] for r in results}) == 1
    rejected = [line for line in logs if "rejected" in line]
    assert rejected and int(re.search(r"\((\d+) in all", rejected[-1])[1]) >= 3, logs


def test_two_runs_at_once_do_not_clash():
    out = {}

    def run(key):
        out[key] = launch(average_rounds, (5,), cpu=2)

    threads = [threading.Thread(target=run, args=(k,)) for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert len({r["digest"] for r in out["a"]}) == 1
    assert out["a"][0]["digest"] == out["b"][0]["digest"]


def test_a_segment_gets_its_pages_or_says_that_shared_memory_is_full():
    """A segment's pages are allocated when it is made: a tmpfs that runs out later would
    kill the worker by SIGBUS at its first write. One larger than the whole of /dev/shm
    is refused at once, naming what it asked and what there is, and leaves no file."""
    from pympgu.runtime import shm
    st = os.statvfs(shm.SHM_DIR)
    seg = shm.Segment(shm.segment_name("7e57", 0), 1 << 20, create=True)
    try:
        assert os.stat(seg.path).st_blocks * 512 >= 1 << 20  # allocated, not sparse
    finally:
        seg.close()
    if not st.f_blocks:
        pytest.skip(f"{shm.SHM_DIR} reports no size")
    name = shm.segment_name("7e57", 1)
    with pytest.raises(OSError, match=r"MiB of shared memory do not fit in /dev/shm, which "
                                      r"has .* MiB free of .*--shm-size") as info:
        shm.Segment(name, st.f_blocks * st.f_frsize + (1 << 20), create=True)
    assert info.value.errno == errno.ENOSPC
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))


def test_ctrl_c_stops_every_worker(tmp_path):
    script = (
        "import sys; sys.path.insert(0, 'tests');"
        "from pympgu.runtime import launch; from runtime_targets import average_rounds;"
        f"launch(average_rounds, (100000, {str(tmp_path)!r}), cpu=2)"
    )
    proc = start([sys.executable, "-c", "import faulthandler, signal; "
                  "faulthandler.register(signal.SIGUSR1); " + script])
    try:
        wait_until(lambda: len(glob.glob(str(tmp_path / "*.pid"))) == 2, 60, every=0.2)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:  # say where the launcher is stuck
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(1.0)
            kill_session(proc)
            _, err = proc.communicate(timeout=10)
            raise AssertionError("the launcher outlived Ctrl-C by 20 s:\n" + err[-6000:])
    finally:
        kill_session(proc)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    # Workers exchanging at full pace heard the launcher's STOP: none waited to be killed.
    assert len(glob.glob(str(tmp_path / "*.stopped"))) == 2, err[-3000:]
    pids = [int(open(p).read()) for p in glob.glob(str(tmp_path / "*.pid"))]
    assert wait_until(lambda: not [p for p in pids if alive(p)], 5), "a worker outlived it"
    assert not shm_left((tmp_path / "run_id").read_text())


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
@pytest.mark.parametrize("nworkers,overlap", [(2, False), (3, True)])
def test_cpu_workers_low_precision_wire(wire, nworkers, overlap):
    results = launch(wire_rounds, (4, wire, overlap), cpu=nworkers)
    assert len({r["digest"] for r in results}) == 1  # replicas stay bit-identical
    assert all(r["stats"]["exchanges"] == 4 for r in results)


@pytest.mark.parametrize("wire,flat,nworkers", [
    (None, False, 2), (None, True, 3), ("bfloat16", False, 3), ("float16", True, 2)])
def test_cpu_workers_average_parts_of_the_layout(wire, flat, nworkers):
    """The momentum alone, then the parameters alone (--overlap --sync-every K); over a
    low-precision wire each keeps its own reference."""
    results = launch(part_rounds, (7, wire, flat), cpu=nworkers)
    assert len({r["digest"] for r in results}) == 1
    assert all(r["stats"]["exchanges"] == 7 for r in results)


def test_exchanger_rejects_parts_that_do_not_fit():
    from pympgu.exchange import Exchanger
    ex = Exchanger.__new__(Exchanger)  # part() reads the layout alone
    ex.layout = [("w", [3, 2], "float32"), ("b", [2], "float32"), ("v_w", [3, 2], "float32"),
                 ("extra", [7], "float32")]
    ex.offsets, ex.total = [0, 64, 128, 192], 256
    assert ex.part(2, 3) == 64 and ex.part(0, 4) == 256
    with pytest.raises(ValueError, match="must have the shapes of the layout's first 2"):
        ex.part(2, 4)
    with pytest.raises(ValueError, match=r"entries \(3, 3\) are not a part"):
        ex.part(3, 3)


@pytest.mark.parametrize("kwargs,message", [
    (dict(method="fastest"), "method must be one of"),
    (dict(wire_dtype="int8"), "wire dtype must be one of"),
    (dict(max_blocks=0), "max_blocks must be 1 to 512"),
    (dict(max_blocks=513), "max_blocks must be 1 to 512"),
])
def test_exchanger_rejects_bad_arguments_before_any_setup(kwargs, message):
    from pympgu.exchange import Exchanger
    ctx = object()  # never touched: the arguments are checked first
    with pytest.raises(ValueError, match=message):
        Exchanger(ctx, [("w", [3], "float32")], **kwargs)


def test_algorithm_thresholds_and_their_overrides(monkeypatch, pympgu_env):
    from pympgu import cuda
    if cuda._cuda is None:
        pytest.skip("built without CUDA")
    for name, fn, default in (("ll_max_bytes", cuda.ll_max_bytes, 256 << 10),
                              ("oneshot_max_bytes", cuda.oneshot_max_bytes, 128 << 10),
                              ("push_min_bytes", cuda.push_min_bytes, 16 << 20),
                              ("ce_min_bytes", cuda.ce_min_bytes, 512 << 20)):
        monkeypatch.delenv(f"PYMPGU_{name.upper()}", raising=False)
        pympgu_env()
        assert fn() == default, name  # the documented defaults (docs/DECISIONS.md)
        pympgu_env(**{name: 12345})
        assert fn() == 12345, name
    pympgu_env(ll_max_bytes=0)  # turns 'll' off
    assert cuda.ll_max_bytes() == 0
    # 'll' cannot take more than its mailboxes hold, whatever the environment says.
    pympgu_env(ll_max_bytes=cuda.LL_MAX_BYTES + 1)
    assert cuda.ll_max_bytes() == cuda.LL_MAX_BYTES
    monkeypatch.delenv("PYMPGU_CE_CHUNK_BYTES", raising=False)
    pympgu_env()
    assert cuda.ce_chunk_bytes() == 16 << 20
    pympgu_env(ce_chunk_bytes=65536)
    assert cuda.ce_chunk_bytes() == 65536
    assert cuda.ce_chunks(2, 1 << 20, "float32")[-2:] == [(1 << 19) - 16384, 1 << 19]


@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("bfloat16", 2)])
@pytest.mark.parametrize("nranks", [2, 3, 8])
def test_ce_chunks_halve_towards_the_end(nranks, dtype, itemsize):
    from pympgu import cuda
    if cuda._cuda is None:
        pytest.skip("built without CUDA")
    per_vec = 16 // itemsize
    rng = np.random.default_rng(nranks)
    sizes = [1, 7, 4096, 1 << 28, 3 * (1 << 26) + 5] + list(rng.integers(1, 1 << 30, 20))
    for n in sizes:
        for chunk_bytes in (16, 100, 8 << 20):
            bounds = cuda.ce_chunks(nranks, int(n), dtype, chunk_bytes)
            # The chunks tile a rank's slice (whole vectors, as the kernels' slices are).
            slice_ = -(-int(n) // (nranks * per_vec)) * per_vec
            assert bounds[0] == 0 and bounds[-1] == slice_, (n, chunk_bytes)
            lens = np.diff(bounds)
            assert (lens > 0).all() and (lens % per_vec == 0).all(), (n, chunk_bytes, lens)
            last = max(per_vec, chunk_bytes // itemsize // per_vec * per_vec)
            # From the end: last, last, then doubling; the first chunk takes the rest, which
            # is at least last (a smaller rest joins it) and under its size plus last.
            want = [last, last] + [last << i for i in range(1, 64)]
            k = len(lens)
            assert list(lens[::-1][:k - 1]) == want[:k - 1], (n, chunk_bytes, lens)
            if k == 1:
                assert lens[0] < 2 * last
            else:
                assert last <= lens[0] < want[k - 1] + last, (n, chunk_bytes, lens)
            assert k <= 64


def test_ce_chunks_names_bad_arguments():
    from pympgu import cuda
    if cuda._cuda is None:
        pytest.skip("built without CUDA")
    with pytest.raises(cuda.CudaError, match="chunk_bytes=8"):
        cuda.ce_chunks(2, 100, "float32", 8)
    with pytest.raises(ValueError, match="unsupported dtype"):
        cuda.ce_chunks(2, 100, "int8")


def test_workers_refuse_settings_that_differ_between_ranks():
    """Every rank's Exchanger compares its settings' fingerprint when it connects: ranks
    that cut their steps or chose algorithms otherwise would wait for each other forever."""
    from pympgu import settings
    from pympgu.exchange.gpu import CudaBackend
    assert "settings" in CudaBackend.ALIKE
    assert settings.load({}).fingerprint() != settings.load(
        {"PYMPGU_BESIDE_BLOCKS": "32"}).fingerprint()
