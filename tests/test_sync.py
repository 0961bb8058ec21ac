"""The training loop's sync schedule and the overlap correction, with fake replicas.

The end-to-end accuracy of each variant is tests/test_train.py's; these pin down the exact
calls and arithmetic, so a regression names its cause.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from pympgu.training.replica import Replica
from pympgu.training.sync import Sync


class FakeEx:
    """An exchanger whose 'average' is a fixed function of what was sent."""

    def __init__(self, average):
        self.average, self.pending, self.sent, self.entries = average, None, [], []

    def start(self, arrays, entries=None, reach="world"):
        assert self.pending is None and reach == "world"  # one node
        self.sent.append([a.copy() for a in arrays])
        self.entries.append(entries)
        self.pending = "exact"

    def finish(self, flat=False):
        assert self.pending is not None
        self.pending = None
        return [self.average(a) for a in self.sent[-1]]


class FakeRep:
    """Replica's exchange methods on numpy values, as on CPU workers. The state is
    ``values``, of which the first ``params`` are parameters and the rest their momentum."""

    exchange = Replica.exchange
    exchange_start = Replica.exchange_start
    exchange_correct = Replica.exchange_correct
    part = Replica.part
    _adopt = Replica._adopt
    _start = Replica._start
    _on_host = Replica._on_host

    def __init__(self, *values, params=None, affine=True):
        self.np, self.jax, self.snapshot = np, None, None
        self.ctx = SimpleNamespace(is_cpu=True)
        self.state = [np.array([v], np.float32) for v in values]
        self.model = SimpleNamespace(state=self.state, params=self.state[:params],
                                     affine_update=affine)
        self.calls = []

    def values(self):
        return self.state

    def set_values(self, values):
        self.state[:] = [np.asarray(v, np.float32) for v in values]

    def wait(self):
        self.calls.append("wait")

    def step(self, delta):
        for v in self.state:
            v += np.float32(delta)  # in place, as PyTensor's C backend updates


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


@pytest.mark.parametrize("every", [2, 3, 4])
def test_overlapped_exchanges_span_the_same_steps_fused_or_not(every):
    # The Python-queued path starts an exchange after the step before the one it spans;
    # the fused path runs it inside that step: the same schedule (but at the epoch's
    # first step, which no exchange started from Python can span).
    rep = FakeRep(0.0, 0.0, params=1)
    ex = FakeEx(lambda a: a)
    sync = Sync(rep, ex, every, overlap=True)
    spans = []
    for i in range(13):
        rep.step(1.0)
        sent = len(ex.sent)
        sync.after_step(i)
        if len(ex.sent) > sent:
            spans.append((i + 1, {(0, 1): "params", (1, 2): "momentum",
                                  (0, 2): "state"}[ex.entries[-1]]))
    assert spans == [(t, sync.spanning(t)) for t in range(1, 14) if sync.spanning(t)]
    assert {p for _, p in spans} == {"state"}


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


class Inside:
    """A StepExchange that says whether the exchange can run inside XLA."""
    why = None
    wire = False  # a half-precision wire: inside XLA by the gradients' road alone

    def unavailable(self, gradients=False):
        return "the bfloat16 wire" if self.wire and not gradients else self.why


@pytest.mark.parametrize("every,overlap,expected", [
    # Every rank starts each step from the same state: the mean gradients where the update
    # allows, else the parameters; the epoch's last step: the whole state.
    (1, False, ["params gradients"] * 5 + ["state gradients"]),
    (2, False, ["step", "state"] * 3),  # replicas drift: momentum averaged too
    # Overlapped steps start from averaged parameters; the epoch's last is plain, so that
    # replicas end identical.
    (1, True, ["params overlapped"] * 5 + ["state"]),
    # With K > 1 the whole state crosses during the due step.
    (4, True, ["step"] * 3 + ["state overlapped", "step", "state"]),
])
@pytest.mark.parametrize("affine", [True, False])
def test_fused_steps_average_parameters_alone_only_when_exact(every, overlap, expected, affine):
    class Rep(FakeRep):
        def step(self, idx, inside=None, part="state", overlap=False, gradients=False):
            self.calls.append(("step" if inside is None else part) +
                              (" overlapped" if overlap else "") +
                              (" gradients" if gradients else ""))

    rep = Rep(0.0, 0.0, params=1, affine=affine)
    rep.jax = object()  # a JAX worker
    if not affine:
        # Adam's moments are never left to each rank: every exchange that would have sent
        # the parameters alone sends the whole state (the road of the mean gradients stays).
        expected = [c.replace("params", "state") if every == 1 else c for c in expected]
    sync = Sync(rep, FakeEx(lambda a: a), every, overlap, Inside())
    assert sync.fused
    for i in range(6):
        sync.step(None, i, last=i == 5)
    assert rep.calls == expected
    assert not Sync(rep, FakeEx(lambda a: a), every).fused  # no StepExchange: from Python


def test_sync_says_why_a_gpu_workers_exchange_runs_outside_xla():
    rep = FakeRep(0.0, 0.0, params=1)
    ex, inside = FakeEx(lambda a: a), Inside()
    assert Sync(rep, ex, inside=inside).outside is None  # CPU workers: no XLA call to join
    rep.ctx = SimpleNamespace(is_cpu=False)
    assert Sync(rep, ex, inside=inside).outside == "PyTensor's C backend has no XLA call"
    rep.jax = object()
    assert Sync(rep, ex, inside=inside).fused and Sync(rep, ex, inside=inside).outside is None
    assert Sync(rep, ex).outside == "its caller asked for it (no StepExchange: make_exchanger(inside=False))"
    inside.wire = True
    assert Sync(rep, ex, inside=inside).fused and Sync(rep, ex, inside=inside).gradients
    for every, overlap in ((2, False), (1, True)):
        assert Sync(rep, ex, every, overlap, inside).outside == "the bfloat16 wire"
    inside.wire = False
    inside.why = "pympgu was built without jaxlib's XLA FFI headers; install jax and rebuild"
    assert Sync(rep, ex, inside=inside).outside == inside.why
    assert Sync(rep, None).outside is None


def test_overlap_with_k_sends_the_whole_state_in_the_due_step():
    # K = 4: one exchange a cycle, of the whole state, spanning the due step (started after
    # step 2, corrected after step 3); none at the step after.
    rep = FakeRep(0.0, 100.0, params=1)
    ex = FakeEx(lambda a: a * 0.5)
    sync = Sync(rep, ex, 4, overlap=True)
    assert [sync.spanning(t) for t in range(9)] == [None, None, None, "state", None, None,
                                                     None, "state", None]
    for i in range(8):
        rep.step(1.0)
        sync.after_step(i)
    assert ex.entries == [(0, 2), (0, 2)]
    # After step 2 the state is (3, 103) and is sent; step 3 moves it to (4, 104),
    # corrected to (4 + 1.5 - 3, 104 + 51.5 - 103) = (2.5, 52.5). Three steps later
    # (5.5, 55.5) is sent; step 7 gives (6.5, 56.5), corrected after it to
    # (6.5 + 2.75 - 5.5, 56.5 + 27.75 - 55.5) = (3.75, 28.75).
    assert [s[0][0] for s in ex.sent] == [3.0, 5.5]
    sync.drain()
    assert [v[0] for v in rep.state] == [3.75, 28.75]


@pytest.mark.parametrize("identical,affine,expected", [
    (False, True, ["params", "params", "state"]),  # the momentum stays each rank's own
    (True, True, ["state"] * 3),  # --min-workers: every exchange a point to go back to
    (False, False, ["state"] * 3),  # Adam's moments are not affine in the gradients
])
def test_cpu_exchanges_send_the_parameters_alone(identical, affine, expected):
    # CPU workers' plain exchanges after every step: SGD's momentum may stay local but at
    # the epoch's last exchange, which leaves the whole state identical.
    rep = FakeRep(0.0, 0.0, params=1, affine=affine)
    ex = FakeEx(lambda a: a)
    run(Sync(rep, ex, 1, identical=identical), rep, [1.0] * 3)
    assert [{(0, 1): "params", (0, 2): "state"}[e] for e in ex.entries] == expected
    assert [len(s) for s in ex.sent] == [{"params": 1, "state": 2}[p] for p in expected]


def test_cpu_exchange_across_nodes_sends_the_state():
    # A meeting of the nodes (reach) carries the outer step and the nodes' inner states.
    rep = FakeRep(0.0, 0.0, params=1)
    sent = []

    class Ex(FakeEx):
        def start(self, arrays, entries=None, reach="world"):
            sent.append((entries, reach))
            self.sent.append(arrays)
            self.pending = "exact"

    sync = Sync(rep, Ex(lambda a: a), 1)
    rep.step(1.0)
    sync.after_step(0, reach="outer")
    assert sent == [((0, 2), "outer")]


class FakeBetween(FakeEx):
    """The host Exchanger of GPU workers under an outer optimizer: it records each
    meeting's reach and entries in ``log`` beside the node's own exchanges."""

    on_host = True

    def __init__(self, log):
        super().__init__(lambda a: a + 10)
        self.log = log

    def start(self, arrays, entries=None, reach="world"):
        self.log.append((reach, entries))
        self.sent.append([a.copy() for a in arrays])
        self.pending = "exact"


def test_gpu_workers_meet_the_other_nodes_after_their_nodes_exchange():
    """Exchanger.between: the node's exchange as K says (inside the node: reach 'world' of
    the node), then, where the loop's reach goes across the nodes, the host's meeting with
    the whole state, whose result the replica takes; 'node' meets no other node."""
    rep = FakeRep(0.0, 0.0, params=1)
    log = []
    ex = FakeEx(lambda a: a * 0.5)
    ex.between = FakeBetween(log)
    start = ex.start
    ex.start = lambda *a, **k: (log.append(("node", k.get("entries"))), start(*a, **k))[1]
    sync = Sync(rep, ex, 2)
    for i, reach in enumerate(["node", "outer", "node", "outer-all"]):
        rep.step(1.0)
        sync.after_step(i, last=i == 3, reach=reach)
    whole = (0, 2)
    assert log == [("node", whole), ("outer", whole), ("node", whole), ("outer-all", whole)]
    # Step 2: (0 + 1 + 1) * 0.5 + 10; step 4: (11 + 1 + 1) * 0.5 + 10.
    assert [float(v[0]) for v in rep.state] == [16.5, 16.5]


def test_fused_gpu_steps_then_meet_the_other_nodes_through_the_host():
    """Inside XLA the step averages inside the node (the gradients' road at K = 1); the
    meetings across the nodes follow the steps whose reach asks for them, whole state."""
    log = []

    class Rep(FakeRep):
        def step(self, idx, inside=None, part="state", overlap=False, gradients=False):
            log.append(("step" if inside is None else part) + (" gradients" if gradients else ""))

    rep = Rep(0.0, 0.0, params=1)
    rep.jax = object()
    ex = FakeEx(lambda a: a)
    ex.between = FakeBetween(log)
    sync = Sync(rep, ex, 1, False, Inside())
    for i, reach in enumerate(["node", "outer", "node", "outer-all"]):
        sync.step(None, i, last=i == 3, reach=reach)
    assert log == ["params gradients", "params gradients", ("outer", (0, 2)),
                   "params gradients", "state gradients", ("outer-all", (0, 2))]
    assert not ex.sent  # the node's exchanges all inside the step

