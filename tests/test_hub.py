"""Node 0's hub deciding a regroup across nodes (pympgu.runtime.hub), its messages caught:
who hands state to whom, and the losses that stop the run rather than wait forever."""
import pytest

from pympgu.runtime import protocol
from pympgu.runtime.failures import WorkerFailed
from pympgu.runtime.hub import Hub

pytestmark = pytest.mark.timeout(60)


class Node0:
    """What the hub calls on node 0's own coordinator."""

    n = 1  # workers a node

    def __init__(self):
        self.regroups = []
        self.ended = False

    def dropped(self, reason):
        pass

    def regroup(self, data, lost=(), reason=None, joined=()):
        self.regroups.append(data)

    def end(self):
        self.ended = True


@pytest.fixture
def hub():
    h = Hub(3, "tcp://127.0.0.1:0", protocol.new_secret(), log=lambda text: None,
            node_timeout=5, join_timeout=60, progress_timeout=60, min_workers=1)
    h.sent = []
    h.listener.broadcast = lambda kind, data, ranks=None: h.sent.append((kind, data))
    h.attach(Node0())
    h.started = True
    try:
        yield h
    finally:
        h.close()


def held(*positions):
    return {"gen": 0, "kept": [[e, d, 10 * e + d] for e, d in positions], "at": None,
            "fresh": False}


def test_a_node_whose_only_worker_was_replaced_takes_a_keepers_state(hub):
    """3 nodes of one worker: node 1's lost and replaced. Node 1 then holds nothing; the
    others go back to their newest common exchange, and node 0, whose worker came through,
    is named both as the source of node 1's state and as the keeper of the outer slices."""
    hub._pause(1, 1, "was killed by signal 9", [1])
    assert hub.sent[-1] == ("DROP", {"gen": 1, "reason": "was killed by signal 9", "node": 1})
    hub.holds(0, held((0, 4), (0, 5)))
    hub.holds(2, held((0, 5), (0, 6)))
    hub.holds(1, {**held(), "fresh": True})
    kind, regroup = hub.sent[-1]
    assert kind == "REGROUP" and regroup == {"gen": 1, "back_to": [0, 5, 5],
                                             "nodes": [0, 1, 2], "source": 0, "keeper": 0}
    assert hub.paused == set()


def test_a_replaced_worker_on_node_0_is_kept_for_by_the_next_node(hub):
    """Node 0's worker replaced (3 nodes of one worker): node 1 keeps the slices."""
    hub._pause(0, 0, "was killed by signal 9", [0])
    for k in (1, 2):
        hub.holds(k, held((0, 5)))
    hub.holds(0, {**held(), "fresh": True})
    assert hub.sent[-1][1]["source"] == hub.sent[-1][1]["keeper"] == 1


def test_with_every_node_paused_no_node_holds_anything_and_the_run_stops(hub):
    for k in range(3):
        hub._pause(k, k, "was killed by signal 9", [k])
    with pytest.raises(WorkerFailed, match="every node's workers are new, and none holds"):
        for k in range(3):
            hub.holds(k, {**held(), "fresh": True})


def test_a_loss_after_a_node_finished_ends_the_run(hub):
    """The run's very end: node 2 finished, so every rank passed the last barrier; then a
    worker of node 1 is lost. Nothing is left to redo: node 1 is told to finish (END) with
    what its workers give, node 0 too, and no node goes back."""
    hub.finished[2] = [{"rank": 2}]
    hub._pause(1, 1, "was killed by signal 9", [1])
    assert hub.sent == [("END", {"reason": "was killed by signal 9 after node(s) [2] "
                                           "finished"})]
    assert hub.coordinator.ended and hub.holding is None and hub.gen == 0
    assert not hub.done()
    hub._from_node(1, "FINISH", {"results": [{"rank": 1}]}, [])
    assert hub.done() and hub.finish([{"rank": 0}]) == [{"rank": r} for r in range(3)]


def test_a_node_that_finishes_while_the_others_go_back_ends_the_run(hub):
    """Node 1's worker lost, every node going back; then node 2 finishes: it had passed the
    last barrier, so the loss came at the very end, and the run ends rather than wait for
    what node 2 holds."""
    hub._pause(1, 1, "was killed by signal 9", [1])
    hub._from_node(2, "FINISH", {"results": []}, [])
    assert hub.sent[-1] == ("END", {"reason": "was killed by signal 9, and node 2 "
                                              "finished"})
    assert hub.coordinator.ended and hub.holding is None and hub.paused == set()


def test_a_node_lost_after_another_finished_leaves_the_run_without_stopping_it(hub):
    hub.finished[2] = []
    hub._drop(1, WorkerFailed(None, "stopped answering", node=1))
    assert hub.alive == [0, 2] and hub.coordinator.ended and hub.done()
