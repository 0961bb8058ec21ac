"""The barrier one node's CPU workers meet at in shared memory (pympgu._host.Barrier)."""
import mmap
import multiprocessing as mp
import time

import numpy as np
import pytest

from pympgu import _host

pytestmark = pytest.mark.timeout(120)


def _rounds(path, nranks, rank, rounds, out):
    """Each round: write the round into this rank's slot, meet, and check every slot."""
    with open(path, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 0)
    words = memoryview(shared)[:_host.BARRIER_BYTES]
    slots = np.frombuffer(shared, np.int64, count=nranks, offset=_host.BARRIER_BYTES)
    barrier = _host.Barrier(words, nranks, rank)
    bad = 0
    for k in range(rounds):
        slots[rank] = k
        if not barrier.arrive():
            while not barrier.wait(1.0, 1000):
                pass
        bad += int(np.any(slots != k))
        # A second meeting before anyone writes the next round's value.
        if not barrier.arrive():
            while not barrier.wait(1.0):
                pass
    out.put((rank, bad, barrier.arrivals(rank)))


@pytest.mark.parametrize("nranks", [2, 3, 8])
def test_no_rank_passes_before_every_rank_has_written(nranks, tmp_path):
    """What every rank wrote before arriving is seen by every rank after it passes, round
    after round, by ranks in processes of their own (more than this machine has cores)."""
    path = tmp_path / "shared"
    path.write_bytes(bytes(_host.BARRIER_BYTES + 8 * nranks))  # mapped by every child
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rounds, args=(str(path), nranks, r, 300, out))
             for r in range(nranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
    assert [p.exitcode for p in procs] == [0] * nranks
    results = sorted(out.get() for _ in range(nranks))
    assert results == [(r, 0, 600) for r in range(nranks)]


def test_a_wait_is_bounded_and_resumes():
    """A rank whose peer has not arrived waits no longer than it is told, and says so; its
    next wait passes once the peer arrives (arrive is not repeated)."""
    shared = mmap.mmap(-1, _host.BARRIER_BYTES)
    first = _host.Barrier(memoryview(shared), 2, 0)
    second = _host.Barrier(memoryview(shared), 2, 1)
    assert not first.arrive()
    t0 = time.monotonic()
    assert not first.wait(0.05)
    assert 0.04 < time.monotonic() - t0 < 1.0
    assert first.arrivals(0) == 1 and first.arrivals(1) == 0
    assert second.arrive()  # the last: every rank is released
    assert first.wait(0.0)
    assert not second.arrive() and not second.wait(0.0)  # the next barrier
    assert first.arrive() and second.wait(0.0)


def test_a_barrier_refuses_what_it_cannot_use():
    shared = mmap.mmap(-1, 2 * _host.BARRIER_BYTES)
    with pytest.raises(ValueError, match="64-byte aligned"):
        _host.Barrier(memoryview(shared)[8:8 + _host.BARRIER_BYTES], 2, 0)
    with pytest.raises(ValueError, match="writable buffer"):
        _host.Barrier(memoryview(shared)[:64], 2, 0)
    with pytest.raises(ValueError, match="writable buffer"):
        _host.Barrier(bytes(_host.BARRIER_BYTES), 2, 0)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        _host.Barrier(memoryview(shared), 2, 2)
    with pytest.raises(ValueError, match="at most"):
        _host.Barrier(memoryview(shared), _host.MAX_RANKS + 1, 0)
