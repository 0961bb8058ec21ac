"""CPU workers' data links between nodes (pympgu.runtime.datalinks) and the sums across
nodes over them (pympgu.exchange.across): ranks of several "nodes" as threads of this
process, the control plane's gather stood in for."""
import socket
import threading
import time

import numpy as np
import pytest

from pympgu.exchange.across import INT8_BLOCK, NodeSum, decode, encode
from pympgu.runtime.control import Stopped
from pympgu.runtime.datalinks import MAGIC, NONCE_BYTES, LinkLost

pytestmark = pytest.mark.timeout(60)


class Run:
    """The ranks of nnodes x nlocal: each a context with the gather and check that NodeSum
    needs. ``on_gather(addresses)`` runs once every rank's address is known, before any
    rank gets them (a stranger's moment)."""

    def __init__(self, nnodes, nlocal, on_gather=None):
        self.nnodes, self.nlocal = nnodes, nlocal
        self.values, self.on_gather = {}, on_gather
        self.lock = threading.Condition()
        self.stop = threading.Event()

    def gather(self, rank, value):
        with self.lock:
            self.values[rank] = value
            if len(self.values) == self.nnodes * self.nlocal:
                if self.on_gather:
                    self.on_gather([tuple(self.values[r]["address"])
                                    for r in sorted(self.values)])
                self.lock.notify_all()
            self.lock.wait_for(lambda: len(self.values) == self.nnodes * self.nlocal, 30)
            return [self.values[r] for r in range(self.nnodes * self.nlocal)]

    def ctx(self, rank):
        run = self

        class Ctx:
            nnodes, local_nranks, data_address = run.nnodes, run.nlocal, "127.0.0.1"
            progress_timeout = 600.0
            node, local_rank = divmod(rank, run.nlocal)

            def gather(self, value):
                return run.gather(rank, value)

            def check(self):
                if run.stop.is_set():
                    raise Stopped("the run is stopping")

            def await_word(self, seconds):
                self.check()  # no launcher here: silence at once
        c = Ctx()
        c.rank = rank
        return c

    def each(self, fn, timeout=30):
        """fn(ctx) on every rank at once; returns their results (or raises the first
        rank's error)."""
        n = self.nnodes * self.nlocal
        results, errors = [None] * n, [None] * n

        def body(r):
            try:
                results[r] = fn(self.ctx(r))
            except BaseException as e:
                errors[r] = e
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in threads), "a rank did not finish"
        for e in errors:
            if e is not None:
                raise e
        return results


def _sums(run, xs, wire, rounds=1):
    def body(ctx):
        s = NodeSum(ctx, timeout=20)
        try:
            return [s(xs[ctx.rank] * (k + 1), wire) for k in range(rounds)], \
                s.sent_bytes(xs[ctx.rank].size, wire)
        finally:
            s.close()
    return run.each(body)


@pytest.mark.parametrize("wire", [None, "bfloat16", "int8"])
@pytest.mark.parametrize("nnodes,nlocal", [(2, 1), (3, 2), (4, 1)])
def test_every_node_gets_the_same_bits(wire, nnodes, nlocal):
    """Each node's slice crossed as the wire says, summed in float32: in node order, or
    (float32 on 3 nodes or more) by a ring, each chunk once; the bytes each rank sent."""
    rng = np.random.default_rng(7)
    n = 3 * INT8_BLOCK + 5  # a partial last block
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(nnodes * nlocal)]
    results = _sums(Run(nnodes, nlocal), xs, wire, rounds=2)
    ring = wire is None and nnodes > 2
    for k in range(2):
        for local in range(nlocal):
            group = [local + node * nlocal for node in range(nnodes)]
            crossed = [decode(encode(xs[r] * (k + 1), wire), n, wire) for r in group]
            expected = crossed[0].copy()
            for c in crossed[1:]:
                expected += c
            for r in group:
                assert np.array_equal(results[r][0][k], results[group[0]][0][k]), (r, k)
                if ring:  # another order of the same sums
                    np.testing.assert_allclose(results[r][0][k], expected, rtol=1e-5,
                                               atol=1e-5)
                else:
                    assert np.array_equal(results[r][0][k], expected), (wire, r, k)
    per_peer = {None: 4 * n, "bfloat16": 2 * n, "int8": n + 4 * 4}[wire]
    for r, (_, sent) in enumerate(results):
        if ring:  # every chunk but two, once each way: near 2 (nodes - 1) / nodes of it
            sizes = np.diff([c * n // nnodes for c in range(nnodes + 1)])
            node = r // nlocal
            assert sent == 4 * (2 * n - sizes[(node + 1) % nnodes] - sizes[(node + 2) % nnodes])
            assert sent < (nnodes - 1) * per_peer
        else:
            assert sent == (nnodes - 1) * per_peer


def test_int8_and_bfloat16_round_to_nearest_even():
    x = np.array([1.00390625, 1.01171875, -2.5, 0.0], np.float32)
    assert list(decode(encode(x, "bfloat16"), 4, "bfloat16")) == [1.0, 1.015625, -2.5, 0.0]
    y = np.zeros(INT8_BLOCK, np.float32)
    y[:3] = [127.0, 0.5, 1.5]  # scale 1: halves round to even
    assert list(decode(encode(y, "int8"), 3, "int8")) == [127.0, 0.0, 2.0]
    with pytest.raises(ValueError, match="no wire 'float16'"):
        encode(x, "float16")


def _stranger(address, send, hold):
    s = socket.create_connection(address, timeout=5)
    if send:
        s.sendall(send)
    hold.append(s)


def test_strangers_at_a_rank_s_port_neither_join_nor_stall_the_links():
    """Junk, a forged hello that cannot prove the key, and a connection that says nothing
    (held open throughout), all at the port of the rank that admits the others: the links
    form at once and carry the right sums."""
    held = []

    def strangers(addresses):
        _stranger(addresses[0], b"GET / HTTP/1.0\r\n\r\n", held)
        _stranger(addresses[0], MAGIC + (1).to_bytes(4, "big") + b"n" * NONCE_BYTES
                  + b"m" * 32, held)
        _stranger(addresses[0], b"", held)
    xs = [np.arange(10, dtype=np.float32) + r for r in range(2)]
    t0 = time.monotonic()
    try:
        results = _sums(Run(2, 1, on_gather=strangers), xs, None)
    finally:
        for s in held:
            s.close()
    assert time.monotonic() - t0 < 4  # not the silent one's handshake limit (5 s)
    assert all(np.array_equal(r[0][0], xs[0] + xs[1]) for r in results)


def test_a_flood_of_silent_connections_neither_takes_descriptors_nor_delays_the_links():
    """Four times MAX_UNPROVEN connections that say nothing, opened while the links form:
    the oldest unproven are closed as new ones come, the link forms at once, and every
    connection the rank took is closed (no descriptor left)."""
    import os

    from pympgu.runtime.datalinks import MAX_UNPROVEN
    held, threads = [], []
    fds = {}

    def flood(addresses):
        def body():
            for _ in range(4 * MAX_UNPROVEN):
                try:
                    _stranger(addresses[0], b"", held)
                except OSError:
                    pass  # the listener closed: the links are up
        threads.append(threading.Thread(target=body, daemon=True))
        threads[0].start()
    xs = [np.full(8, r + 1, np.float32) for r in range(2)]
    fds["before"] = len(os.listdir("/proc/self/fd"))
    t0 = time.monotonic()
    try:
        results = _sums(Run(2, 1, on_gather=flood), xs, None)
        took = time.monotonic() - t0
        threads[0].join(30)
        assert all(_closed_by_peer(s) for s in held)
        assert len(os.listdir("/proc/self/fd")) - fds["before"] == len(held)
    finally:
        for s in held:
            s.close()
    assert took < 4
    assert all(np.array_equal(r[0][0], xs[0] + xs[1]) for r in results)


def _closed_by_peer(s):
    s.settimeout(2)
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def test_a_peer_that_closes_its_link_is_named():
    run = Run(2, 1)

    def body(ctx):
        s = NodeSum(ctx, timeout=20)
        try:
            if ctx.node == 1:
                return None
            time.sleep(0.3)  # node 1 is gone by then
            return s(np.ones(1000, np.float32))
        finally:
            s.close()
    with pytest.raises(LinkLost, match=r"rank 1 \(node 1\) closed its link"):
        run.each(body)


def test_a_stop_ends_a_wait_for_a_peer():
    run = Run(2, 1)

    def body(ctx):
        s = NodeSum(ctx, timeout=20)
        try:
            if ctx.node == 1:
                time.sleep(1.0)  # silent while node 0 waits, until the run stops
                return None
            threading.Timer(0.2, run.stop.set).start()
            return s(np.ones(10, np.float32))
        finally:
            s.close()
    with pytest.raises(Stopped):
        run.each(body)


def test_a_peer_that_sends_nothing_is_named_after_the_hang_check():
    run = Run(2, 1)

    def body(ctx):
        ctx.progress_timeout = 0.5
        s = NodeSum(ctx, timeout=20)
        try:
            if ctx.node == 1:
                time.sleep(1.5)  # alive, linked, and silent
                return None
            return s(np.ones(10, np.float32))
        finally:
            s.close()
    with pytest.raises(LinkLost, match=r"rank 1 \(node 1\) moved nothing for 0.5 s while "
                                       r"rank 0 waited for it \(hung\?\)"):
        run.each(body)


def test_a_peer_that_never_dials_is_named_after_the_timeout():
    run = Run(2, 1)

    def body(ctx):
        if ctx.node == 1:  # says where it listens, and never dials
            ctx.gather({"address": ["127.0.0.1", 9], "key": None})
            return None
        return NodeSum(ctx, timeout=0.5)
    with pytest.raises(LinkLost, match=r"rank 1 \(node 1\) made no data link with rank 0"):
        run.each(body)
