"""Which of a node's workers are still in the run, and the way on without one (--min-workers).

A lost worker (dead, or hung and killed) is dropped while at least ``min_workers`` remain:
the coordinator tells the survivors (SHRINK), each says which exchanges it holds the state of
(RECOVER: the last two, docs/DECISIONS.md, "Going on without a lost worker"), and once all
have, the newest that every one holds is where they all go back to (REFORM). Workers keep
their process's slot (their link's number) for good; their rank is their place among the
survivors, in slot order.

Across nodes every node keeps as many workers: a lost one's slot waits for its replacement
(``pause``), and the node says what it holds only once that one is ready too.
"""
import time

from .failures import WorkerFailed


class Membership:
    """The ``members`` (slots, in rank order) of a node of ``n`` workers, ``min_workers`` of
    whom must remain (None: every one, and no loss is survived)."""

    def __init__(self, n, min_workers=None):
        self.n, self.members = n, list(range(n))
        self.min_workers = n if min_workers is None else min_workers
        self.recovering = None  # from SHRINK to REFORM: what the survivors said, and of whom
        self.announce = None  # from REFORM to the survivors' next completed exchange
        # Joined, but not yet through an exchange with the others: they hold no state of
        # the run until then, whatever comes in between.
        self.fresh = set()
        # New workers that took up their predecessors' state (``ready``): they hold it, and
        # are told as joined all the same.
        self.renewed = set()

    @property
    def elastic(self):
        """Whether a worker may be lost at all (--min-workers below the workers)."""
        return self.min_workers < self.n

    @property
    def recovered_slots(self):
        """The survivors that have said what they hold, while the others have not."""
        return set(self.recovering["kept"]) if self.recovering else set()

    def rank(self, slot):
        """The rank of the worker in ``slot`` now (its slot's number, once it is lost)."""
        return self.members.index(slot) if slot in self.members else slot

    def heard(self, slot, kind):
        """Whether a message of ``kind`` from ``slot`` counts: none from a lost worker, and
        while the survivors recover, none that a survivor sent before its RECOVER."""
        if slot not in self.members:
            return False
        if self.recovering is None or kind not in ("REGISTER", "BARRIER", "WAITING"):
            return True
        return slot in self.recovering["kept"]

    def lose(self, slot, error, now):
        """Drop the worker in ``slot``, which failed with ``error`` (WorkerFailed); returns
        the SHRINK payload for the survivors. Raises ``error`` itself, saying why, where
        fewer than min_workers would remain."""
        if not self.elastic:
            raise error
        if len(self.members) - 1 < self.min_workers:
            note = (f"; {len(self.members) - 1} worker(s) would remain, fewer than "
                    f"--min-workers {self.min_workers}: the run stops")
            raise WorkerFailed(error.rank, error.reason + note, error.details, node=error.node)
        rank = self.members.index(slot)
        self.members.remove(slot)
        first = self.recovering or {}
        self.recovering = {"lost": first.get("lost", []) + [(rank, error.reason)],
                           "joining": first.get("joining", []),
                           "since": first.get("since", now), "kept": {}, "at": []}
        return {"lost": rank, "reason": error.reason}

    def grow(self, slots, now):
        """The restarted workers in ``slots`` join; returns the SHRINK payload that sends the
        others back to their last exchange to take them in."""
        self.recovering = {"lost": [], "joining": list(slots), "since": now, "kept": {},
                           "at": []}
        return {"lost": None, "reason": f"{len(slots)} restarted worker(s) join"}

    def pause(self, slot, rank, reason, now):
        """Across nodes, with restarts: the worker in ``slot`` (the run's ``rank``) is lost
        and its replacement will take the same slot; the survivors go back, and this node
        holds nothing to say until the replacement is ready (``ready``). ``rank`` None: a
        worker that was not lost, stopped to be started again with its node's."""
        self.members.remove(slot)
        first = self.recovering or {}
        lost = [(rank, reason)] if rank is not None else []
        self.recovering = {"lost": first.get("lost", []) + lost,
                           "joining": first.get("joining", []),
                           "waiting": first.get("waiting", set()) | {slot},
                           "since": first.get("since", now), "kept": {}, "at": []}

    def late(self, now):
        """This node joins a run under way: each worker will say it holds nothing, and
        the node takes another node's state."""
        self.recovering = {"lost": [], "joining": [], "since": now, "kept": {}, "at": []}
        self.fresh = set(self.members)

    def ready(self, slot, kept=()):
        """The replacement in ``slot`` is ready to join: what ``holds`` returns. ``kept``:
        the positions of the state it took up from its predecessor, if any (a node that
        starts every worker again: pympgu.training.carried)."""
        rec = self.recovering
        if rec is None or slot not in rec.get("waiting", ()):
            return None
        rec["waiting"].discard(slot)
        rec["joining"].append(slot)
        if kept:
            rec.setdefault("carried", {})[slot] = [tuple(p[:2]) for p in kept]
            rec["steps"] = {**rec.get("steps", {}), **{tuple(p[:2]): p[2] for p in kept}}
        return self._held()

    def drop_joiner(self, slot):
        """A joiner lost before it joined."""
        if self.recovering is not None and slot in self.recovering["joining"]:
            self.recovering["joining"].remove(slot)
            if "waiting" in self.recovering:  # across nodes: its slot waits for another
                self.recovering["waiting"].add(slot)

    def recovered(self, slot, kept, at):
        """RECOVER from ``slot``: the positions whose state it holds (oldest first) and where
        it was. Returns the REFORM payload once every survivor has said, else None. A survivor
        that holds none (lost before the first exchange), or positions no one else holds,
        ends the run."""
        held = self.holds(slot, kept, at)
        if held is None:
            return None
        common = {tuple(p[:2]) for p in held["kept"]}
        if not common:
            rec = self.recovering
            rank, reason = rec["lost"][0] if rec["lost"] else (None, "a worker joined")
            raise WorkerFailed(rank, f"{reason} {stops(held['fresh'])}")
        return self.reform(max(common))

    def holds(self, slot, kept, at):
        """RECOVER from ``slot`` noted; once every survivor has said: the positions (with
        their steps) that all of them hold, where the furthest was, and whether any held
        nothing yet (``fresh``), else None. Across nodes node 0 picks among every node's."""
        rec = self.recovering
        if rec is None or slot not in self.members:
            return None  # said twice across two losses: the second is the answer
        rec["kept"][slot] = [tuple(p[:2]) for p in kept]
        if slot in self.fresh:
            rec["kept"][slot] = None
        rec["steps"] = {**rec.get("steps", {}), **{tuple(p[:2]): p[2] for p in kept}}
        if at is not None:
            rec["at"].append(at)
        return self._held()

    def _held(self):
        rec = self.recovering
        if len(rec["kept"]) < len(self.members) or rec.get("waiting"):
            return None
        holders = [set(k) for k in rec["kept"].values() if k is not None]
        holders += [set(k) for k in rec.get("carried", {}).values()]
        common = set.intersection(*holders) if holders else set()
        return {"kept": [[*p, rec["steps"][p]] for p in sorted(common)],
                "at": max(rec["at"], default=None, key=lambda a: a[2]),
                "fresh": not all(holders)}

    def external(self, now):
        """Another node was dropped, or waits for a replacement: this node's workers go back
        too (say again what they hold), none of them lost here since."""
        first = self.recovering or {}
        self.recovering = {"lost": first.get("lost", []), "joining": first.get("joining", []),
                           "waiting": first.get("waiting", set()),
                           "since": first.get("since", now), "kept": {}, "at": []}

    def reform(self, back_to, lost=(), reason=None, workers=None, joined=()):
        """Every survivor goes back to ``back_to`` (a position every one holds); returns the
        REFORM payload. For the record, across nodes: the ranks lost with another node
        (``lost``), why (``reason``), the workers of every node that go on, and the ranks
        that other nodes' replacements take (``joined``)."""
        rec = self.recovering
        if len(back_to) > 2:  # node 0's REGROUP says the step (a node that joins holds none)
            rec["steps"] = {**rec.get("steps", {}), tuple(back_to[:2]): back_to[2]}
        back_to = tuple(back_to[:2])
        rec["lost"] = rec["lost"] + [(r, reason if k == 0 else None)
                                     for k, r in enumerate(lost)]
        carried = sorted(rec.get("carried", {}))
        holding = [s for s in self.members if rec["kept"][s] is not None] + carried
        self.fresh |= set(rec["joining"]) - set(carried)
        self.renewed |= set(carried)
        self.members = sorted(self.members + rec["joining"])
        # Told once the workers are through an exchange: what happened since the last time.
        told = self.announce or {"lost": [], "reason": [], "since": rec["since"]}
        self.announce = {
            "lost": told["lost"] + [r for r, _ in rec["lost"]],
            "joined": sorted({*(self.members.index(s) for s in self.fresh | self.renewed),
                              *joined}),
            "reason": told["reason"] + [w for _, w in rec["lost"] if w is not None],
            # Steps counted from 1: the one under way when the loss came, the next to run.
            "at_step": max((a[2] for a in rec["at"]), default=rec["steps"][back_to]) + 1,
            "epoch": back_to[0] + 1, "from_step": rec["steps"][back_to] + 1,
            "workers": workers or len(self.members),
            "since": min(told["since"], rec["since"])}
        self.recovering = None
        root = self.members.index(holding[0]) if self.fresh and holding else None
        return {"members": self.members, "back_to": [*back_to, rec["steps"][back_to]],
                "root": root, "node": 0, "nnodes": 1, "source": None,
                "keeper": None}

    def record(self, now=None):
        """The membership change in metrics.jsonl's words, once the survivors have completed
        an exchange after it; None if there is none to tell."""
        a, self.announce = self.announce, None
        if a is None:
            return None
        a["reason"] = "; ".join(a["reason"])
        self.fresh.clear()  # through an exchange with the others: they hold the run's state
        self.renewed.clear()
        now = time.monotonic() if now is None else now
        return {"kind": "membership", "event": "membership", "epoch": a["epoch"],
                "lost": a["lost"], "joined": a["joined"], "reason": a["reason"],
                "at_step": a["at_step"], "from_step": a["from_step"], "workers": a["workers"],
                "seconds": round(now - a["since"], 3), "time": time.time()}


def stops(fresh):
    """Why a recovery with no exchange in common stops the run, in words."""
    why = ("before the workers' first exchange" if fresh
           else "and the survivors hold no exchange in common")
    return f"{why}: the run stops (it goes on only from a state every survivor holds)"
