"""The training loop's sync schedule and the overlap correction, with fake replicas.

The end-to-end accuracy of each variant is tests/test_train.py's; these pin down the exact
calls and arithmetic, so a regression names its cause.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from pympgu.train import Replica, Sync


class FakeEx:
    """An exchanger whose 'average' is a fixed function of what was sent."""

    def __init__(self, average):
        self.average, self.pending, self.sent = average, None, []

    def start(self, arrays):
        assert self.pending is None
        self.sent.append([a.copy() for a in arrays])
        self.pending = "exact"

    def finish(self, flat=False):
        assert self.pending is not None
        self.pending = None
        return [self.average(a) for a in self.sent[-1]]


class FakeRep:
    """Replica's exchange methods on numpy values, as on CPU workers."""

    exchange = Replica.exchange
    exchange_start = Replica.exchange_start
    exchange_correct = Replica.exchange_correct
    _adopt = Replica._adopt
    _start = Replica._start

    def __init__(self, value):
        self.np, self.jax, self.snapshot = np, None, None
        self.ctx = SimpleNamespace(is_cpu=True)
        self.state = [np.array([value], np.float32)]
        self.calls = []

    def values(self):
        return self.state

    def set_values(self, values):
        self.state = [np.asarray(v, np.float32) for v in values]

    def wait(self):
        self.calls.append("wait")

    def step(self, delta):
        self.state[0] += np.float32(delta)  # in place, as PyTensor's C backend updates


def run(sync, rep, deltas, every_epoch_end=True):
    for i, d in enumerate(deltas):
        rep.step(d)
        sync.after_step(i, last=every_epoch_end and i == len(deltas) - 1)
    sync.drain()


@pytest.mark.parametrize("every,expected", [(1, 5), (2, 3), (3, 2), (5, 1)])
def test_plain_sync_points(every, expected):
    rep = FakeRep(0.0)
    ex = FakeEx(lambda a: a * 0.5)
    run(Sync(rep, ex, every), rep, [1.0] * 5)
    assert len(ex.sent) == expected  # every k steps and the epoch's last
    assert ex.pending is None


def test_overlap_applies_the_delayed_correction():
    # The average halves what was sent. Step 1 sends 1; step 2 moves to 3 meanwhile; the
    # correction gives 3 + (0.5 - 1) = 2.5, which is sent; then the epoch ends with no step
    # in between, so the values become that average exactly: 1.25.
    rep = FakeRep(0.0)
    ex = FakeEx(lambda a: a * 0.5)
    sync = Sync(rep, ex, 1, overlap=True)
    rep.step(1.0)
    sync.after_step(0)
    assert ex.pending and rep.state[0][0] == 1.0  # started, not yet applied
    rep.step(2.0)
    sync.after_step(1, last=True)
    assert [s[0][0] for s in ex.sent] == [1.0, 2.5]
    sync.drain()
    assert rep.state[0][0] == 1.25 and ex.pending is None


def test_overlap_corrects_one_step_after_the_start_whatever_k():
    # With K = 4 the exchange started after step 3 is applied after step 4, not at the
    # next sync point (after step 7): a correction K steps late made training unstable.
    rep = FakeRep(0.0)
    ex = FakeEx(lambda a: a * 0.5)
    sync = Sync(rep, ex, 4, overlap=True)
    pending = []
    for i in range(6):
        rep.step(1.0)
        sync.after_step(i)
        pending.append(ex.pending is not None)
    assert pending == [False, False, False, True, False, False]
    # Sent 4 after step 3; step 4 moved to 5; corrected: 5 + (2 - 4) = 3; step 5: 4.
    assert [s[0][0] for s in ex.sent] == [4.0] and rep.state[0][0] == 4.0


def test_overlap_snapshot_survives_in_place_updates():
    # The C backend mutates shared storage in place: the snapshot must be a copy, or the
    # correction would subtract the new value from itself.
    rep = FakeRep(10.0)
    ex = FakeEx(lambda a: a)  # the average equals what was sent: a no-op exchange
    sync = Sync(rep, ex, 1, overlap=True)
    run(sync, rep, [1.0, 1.0, 1.0])
    assert rep.state[0][0] == 13.0  # every step kept, none counted twice


def test_single_worker_never_exchanges():
    rep = FakeRep(0.0)
    sync = Sync(rep, None, 1, overlap=True)
    run(sync, rep, [1.0, 1.0])
    assert "wait" not in rep.calls and rep.state[0][0] == 2.0


@pytest.mark.parametrize("every,overlap,expected", [
    (1, False, ["params", "params", "params", "all"]),  # the epoch's last step: all
    (2, False, ["step", "all", "step", "all"]),  # replicas drift: momentum averaged too
    # Overlapped steps start from averaged parameters; the epoch's last is plain, so that
    # replicas end identical.
    (1, True, ["params overlapped", "params overlapped", "params overlapped", "all"]),
    (2, True, ["step", "all overlapped", "step", "all"]),
])
def test_fused_steps_average_parameters_alone_only_when_exact(every, overlap, expected):
    class Rep(FakeRep):
        def step(self, idx, ex=None, params_only=False, overlap=False):
            call = "step" if ex is None else "params" if params_only else "all"
            self.calls.append(call + (" overlapped" if overlap else ""))

    class Ex(FakeEx):
        def xla_unavailable(self):
            return None

    rep = Rep(0.0)
    rep.jax = object()  # a JAX worker
    sync = Sync(rep, Ex(lambda a: a), every, overlap=overlap)
    assert sync.fused
    for i in range(4):
        sync.step(None, i, last=i == 3)
    assert rep.calls == expected
    assert not Sync(rep, Ex(lambda a: a), every, fuse=False).fused  # PYMPGU_XLA_EXCHANGE=0
