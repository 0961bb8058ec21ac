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

    def dropped(self, reason):
        pass

    def regroup(self, data, lost=(), reason=None, joined=()):
        self.regroups.append(data)


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


def test_a_loss_after_a_node_finished_stops_the_run(hub):
    """The run's very end: node 2 finished (its launcher gone), then a worker of node 1 is
    lost. Node 2 would never say what it holds: the run stops rather than wait for it."""
    hub.finished[2] = []
    with pytest.raises(WorkerFailed, match=r"after node\(s\) \[2\] finished"):
        hub._pause(1, 1, "was killed by signal 9", [1])


def test_a_node_that_finishes_while_the_others_go_back_stops_the_run(hub):
    hub._pause(1, 1, "was killed by signal 9", [1])
    with pytest.raises(WorkerFailed, match="node 2 finished while every node went back"):
        hub._from_node(2, "FINISH", {"results": []}, [])
