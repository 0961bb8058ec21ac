"""The control plane's two ends: a launcher's Listener (ZMQ ROUTER) and a Link (DEALER) to it.

Inside a node the launcher listens on a Unix socket in the run's private directory
(``ipc://``, pympgu.runtime.rundir): no other user can connect at all. Between nodes node 0
listens on TCP; there the nodes' secret also gives the connection's CURVE keys, so that a
connection that cannot prove it holds the secret is dropped by ZMQ's handshake, within
HANDSHAKE_S, and no more than MAX_PENDING connections are ever left waiting for one
(docs/DECISIONS.md, "Who may connect").

Every message is sealed (pympgu.runtime.protocol) under the run's key: the 32 random bytes
that the launcher hands its workers through the spawn pipe; between nodes a key of the run's
own from the nodes' secret (``fresh_key``): each node's link KNOCKs with a nonce, node 0
answers with its NONCE, fresh each run, under a MAC of both nonces, and every message after
is sealed under HMAC(secret, NONCE). Each sender numbers its messages: a number not above
the last one accepted is a replay, dropped, as is a second HELLO for a rank. Rejected
messages and dropped connections are summed up in one line at most every few seconds.
"""
import hmac
import os
import secrets
import socket
import time

import zmq
from zmq.utils import z85

from .protocol import (MAX_FRAME_BYTES, NONCE_BYTES, NONCE_DIRECTION, PROTOCOL_VERSION,
                       TO_COORDINATOR, TO_COORDINATOR_DIRECTION, TO_WORKER,
                       TO_WORKER_DIRECTION, Rejected, mac, new_secret, printable, run_key,
                       seal, unseal)

REJECT_SUMMARY_S = 5.0  # at most one line about rejected messages this often
HANDSHAKE_S = 5.0  # a TCP connection's CURVE handshake must end this soon
# TCP connections that have sent no message, at most: MAX_PENDING once GRACE_S old (a
# node's link has sent its first message by then), 4 * MAX_PENDING younger ones.
MAX_PENDING = 32
GRACE_S = 0.5


class BindError(OSError):
    """A Listener cannot listen on the address asked for (a port in use, say)."""


class Stopped(Exception):
    """The coordinator told this worker to stop (another rank failed, or Ctrl-C)."""


class Shrunk(Exception):
    """A rank was lost and the run goes on without it (--min-workers), or a restarted
    worker joins (``lost`` None): this worker leaves what it was doing and recovers
    (pympgu.training.recovery). ``lost``: the rank, as the run numbered it until now;
    ``reason``: what became of it."""

    def __init__(self, lost, reason):
        self.lost, self.reason = lost, reason
        super().__init__(reason if lost is None else f"rank {lost} {reason}")


def _interrupting(kind, data):
    """The exception that message ``kind`` raises wherever a worker reads it, or None."""
    if kind == "STOP":
        return Stopped(data["reason"])
    if kind == "SHRINK":
        return Shrunk(data["lost"], data["reason"])
    return None


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_FAILED_ANY = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                         | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# A node's handshakes that fail in a row, for so long, before it calls its secret another
# than node 0's.
MISMATCHED_HANDSHAKES, MISMATCHED_S = 3, 1.5


def curve_keys(secret):
    """(server public, server secret, client public, client secret) CURVE keys, Z85, that
    the nodes' secret gives: a connection without the secret fails ZMQ's handshake."""
    import hashlib
    keys = []
    for role in (b"server", b"client"):
        private = z85.encode(hmac.new(secret, b"pympgu curve " + role, hashlib.sha256).digest())
        keys += [zmq.curve_public(private), private]
    return tuple(keys)


def _socket(context, kind):
    s = context.socket(kind)
    s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    return s


class Listener:
    """A launcher's end: receives, authenticates, validates and answers its peers' messages
    (its workers', or node 0's other nodes'). ``endpoint``: ``ipc://PATH``, or
    ``tcp://HOST:PORT`` (PORT 0: any free one). ``secret``: the run's key (new_secret), or
    with ``fresh_key`` (node 0 of several) the nodes' secret, from which this run's key and
    the CURVE keys come. ``log`` takes the summary lines of what it rejects."""

    def __init__(self, nranks, endpoint, secret=None, log=None, kinds=TO_COORDINATOR,
                 hello="HELLO", fresh_key=False):
        self.nranks = nranks
        self.kinds, self.hello = kinds, hello
        self.secret = secret or new_secret()
        self._shared = self.nonce = None
        self.log = log or (lambda msg: None)
        self.rejected = self.dropped = 0
        self._unreported, self._last_reason, self._reported_at = 0, "", 0.0
        self._unreported_drops = 0
        self.context = zmq.Context()
        self.socket = _socket(self.context, zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A worker that died and restarted must not leave messages queued for a dead peer;
        # a link that reconnects keeps its place (its routing id is its own, Link).
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # A TCP connection's descriptor -> its peer, from its acceptance to its first
        # message (what says that its handshake passed); those that have spoken.
        self.monitor, self._pending, self._spoke = None, {}, set()
        if fresh_key:
            self._shared, self.nonce = self.secret, secrets.token_bytes(NONCE_BYTES)
            self.secret = run_key(self._shared, self.nonce)
            public, private, _, _ = curve_keys(self._shared)
            self.socket.curve_server = True
            self.socket.curve_publickey, self.socket.curve_secretkey = public, private
            self.socket.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
            self.monitor = self.socket.get_monitor_socket(
                zmq.EVENT_LISTENING | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_CLOSED | _HANDSHAKE_FAILED_ANY)
        try:
            if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
                port = self.socket.bind_to_random_port(endpoint[:-2])
                endpoint = f"{endpoint[:-2]}:{port}"
            else:
                self.socket.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise BindError(e.errno, os.strerror(e.errno), endpoint) from None
        self.address = endpoint
        self.port = int(endpoint.rpartition(":")[2]) if endpoint.startswith("tcp") else None
        if self.monitor is not None:
            self._defer_accept()
        self.identities = {}  # rank -> ZMQ identity of its main socket
        self.last_seq = {}  # (rank, heartbeat?) -> the last sequence number accepted
        self.sent_seq = [0] * nranks

    @property
    def sockets(self):
        """What a poller waits on for this listener: its socket, and its monitor's."""
        return [self.socket] + ([self.monitor] if self.monitor is not None else [])

    def receive(self, timeout_ms):
        """One valid message as (rank, kind, payload, blobs), or None after timeout_ms."""
        self.police()
        self._summarize()
        if not self.socket.poll(timeout_ms):
            return None
        frames = self.socket.recv_multipart(copy=False)
        if self.monitor is not None:  # past the CURVE handshake: a holder of the secret
            fd = frames[-1].get(zmq.SRCFD)
            self._spoke.add(fd)
            self._pending.pop(fd, None)
        try:
            return self._accept(frames)
        except Rejected as e:
            self.rejected += 1
            self._unreported += 1
            self._last_reason = str(e)
            return None

    def _accept(self, frames):
        """(rank, kind, payload, blobs) of a valid message; None for a knock, answered."""
        identity, *frames = frames
        identity = bytes(identity)
        if self._shared is not None and len(frames) == 2 and bytes(frames[0]) == b"KNOCK":
            return self._answer(identity, bytes(frames[1]))
        kind, rank, seq, data, blobs = unseal(self.secret, TO_COORDINATOR_DIRECTION, frames,
                                              self.kinds, self.nranks)
        key = (rank, kind == "HEARTBEAT")
        if seq <= self.last_seq.get(key, 0):
            raise Rejected(f"{kind} from rank {rank} replayed (number {seq})")
        if kind == self.hello:
            if rank in self.identities:
                raise Rejected(f"a second {kind} for rank {rank}")
            if data["version"] != PROTOCOL_VERSION:
                raise Rejected(f"rank {rank} speaks protocol {data['version']}, this "
                               f"launcher {PROTOCOL_VERSION}")
            self.identities[rank] = identity
        elif kind != "HEARTBEAT" and self.identities.get(rank) != identity:
            raise Rejected(f"{kind} for rank {rank} from a socket that did not say "
                           f"{self.hello} as it")
        self.last_seq[key] = seq
        return rank, kind, data, blobs

    def _answer(self, identity, nonce):
        """Node 0's NONCE to a knock: anyone past the handshake may have it, only a holder
        of the secret can seal with the key it gives, and the knocker checks that it is
        fresh."""
        if len(nonce) != NONCE_BYTES:
            raise Rejected("a malformed KNOCK")
        answer = [b"NONCE", self.nonce]
        try:
            self.socket.send_multipart(
                [identity, *answer, mac(self._shared, NONCE_DIRECTION, [nonce, self.nonce])],
                zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        return None

    def _defer_accept(self):
        """Have the kernel hold a connection that sends nothing (a ZMQ peer speaks at once)
        out of this process: an idle one costs it no descriptor (TCP_DEFER_ACCEPT)."""
        from zmq.utils.monitor import recv_monitor_message
        if self.monitor.poll(1000):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_LISTENING:
                try:
                    with socket.socket(fileno=os.dup(event["value"])) as s:
                        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT,
                                     int(HANDSHAKE_S))
                except (OSError, AttributeError):  # not Linux: the cap alone holds
                    pass

    def police(self):
        """Follow the TCP connections from their acceptance to their first message, and
        shut the oldest of those that have sent none beyond MAX_PENDING, once GRACE_S old
        (ZMQ itself drops one whose handshake has not passed after HANDSHAKE_S)."""
        if self.monitor is None:
            return
        from zmq.utils.monitor import recv_monitor_message
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                if fd not in self._spoke:  # its first message may come first
                    self._pending[fd] = (_peer(fd), time.monotonic())
            elif event["event"] in _HANDSHAKE_FAILED:  # it holds another secret, or none
                self.dropped += 1
                self._unreported_drops += 1
            else:  # gone (the value is the descriptor, which another connection may reuse)
                self._pending.pop(fd, None)
                self._spoke.discard(fd)
        now = time.monotonic()
        while len(self._pending) > MAX_PENDING:
            fd, (peer, since) = next(iter(self._pending.items()))  # the oldest
            if now - since < GRACE_S and len(self._pending) <= 4 * MAX_PENDING:
                break  # a node's link speaks sooner: this one may be one
            _shut(fd, peer)
            del self._pending[fd]
            self.dropped += 1
            self._unreported_drops += 1

    def _summarize(self, force=False):
        now = time.monotonic()
        if not force and now - self._reported_at < REJECT_SUMMARY_S:
            return
        if self._unreported:
            self.log(f"rejected {self._unreported} message(s) on {self.address} "
                     f"({self.rejected} in all; the last: {printable(self._last_reason, 200)})")
        if self._unreported_drops:
            self.log(f"dropped {self._unreported_drops} connection(s) to "
                     f"{self.address} that had not shown the nodes' secret ({self.dropped} "
                     "in all)")
        if self._unreported or self._unreported_drops:
            self._unreported = self._unreported_drops = 0
            self._reported_at = now

    def forget(self, rank):
        """A new process takes ``rank``'s place (a restarted worker): its HELLO is
        accepted, and its messages are numbered from the start again."""
        self.identities.pop(rank, None)
        for key in [(rank, False), (rank, True)]:
            self.last_seq.pop(key, None)
        self.sent_seq[rank] = 0

    def send(self, rank, kind, payload=None, blobs=()):
        identity = self.identities.get(rank)
        if identity is None:
            return False
        self.sent_seq[rank] += 1
        frames = seal(self.secret, TO_WORKER_DIRECTION, kind, rank, self.sent_seq[rank],
                      payload or {}, blobs)
        try:
            self.socket.send_multipart([identity, *frames], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def broadcast(self, kind, payload=None, blobs=(), ranks=None):
        """Send to every rank, or to those of ``ranks``."""
        for rank in range(self.nranks) if ranks is None else ranks:
            self.send(rank, kind, payload, blobs)

    def close(self):
        self._summarize(force=True)
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(0)
        self.socket.close(0)
        self.context.term()


def _peer(fd):
    """The far end of connection ``fd`` (None if it is gone): what tells it from a later
    connection that reuses the number."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            return s.getpeername()
    except OSError:
        return None


def _shut(fd, peer):
    """End connection ``fd`` if it is still the one from ``peer``: ZMQ sees it closed and
    forgets it. A shutdown, not a close: the descriptor stays ZMQ's."""
    if peer is None:
        return
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            if s.getpeername() == peer:
                s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Link:
    """A worker's end (or a node's, to node 0): requests to the listener, replies, and a
    heartbeat thread.

    ``on_orphaned`` runs when the launcher is found gone (killed outright), just before
    this process exits: what it created that would outlive it is removed there.

    With ``fresh_key`` (a node's link to node 0) ``secret`` is the nodes': the link
    connects with the CURVE keys it gives, knocks, and holds what it sends until node 0's
    NONCE gives the run's key. ``secret_mismatch`` says that node 0 answered under another
    secret."""

    def __init__(self, address, secret, rank, nranks, heartbeat_s=1.0, on_orphaned=None,
                 kinds=TO_WORKER, watch_parent=True, fresh_key=False):
        import threading
        self.address, self.rank, self.nranks = address, rank, nranks
        self._secret = secret
        self._shared = self._nonce = self._curve = None
        self._held = []  # what was sent before the run's key was known
        self._mismatch, self._failed, self._failing_since, self._monitor = False, 0, None, None
        self.kinds = kinds
        self.on_orphaned = on_orphaned
        self.watch_parent = watch_parent
        self.context = zmq.Context()
        if fresh_key:
            self._shared, self._secret = secret, None
            self._curve = curve_keys(secret)
        self.socket = self._connect(monitor=fresh_key)
        self.socket.setsockopt(zmq.LINGER, 2000)  # let a final ERROR/DONE leave
        if fresh_key:
            self._nonce = secrets.token_bytes(NONCE_BYTES)
            self.socket.send_multipart([b"KNOCK", self._nonce])
        self.parent = os.getppid()
        self.seq = 0
        self.last_received = 0
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True)
        self._heartbeat.start()

    def _connect(self, monitor=False):
        s = _socket(self.context, zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, b"p" + secrets.token_bytes(15))
        if self._curve is not None:
            server, _, public, private = self._curve
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server, public, private
        if monitor:
            self._monitor = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                                 | _HANDSHAKE_FAILED_ANY)
        s.connect(self.address)
        return s

    @property
    def secret_mismatch(self):
        """Whether node 0 holds another secret than this node's: it refuses the handshake
        that this node's keys make (or answers a knock under another secret)."""
        if self._monitor is not None:
            from zmq.utils.monitor import recv_monitor_message
            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)["event"]
                self._failed = self._failed + 1 if event in _HANDSHAKE_FAILED else 0
                if self._failed == 1:
                    self._failing_since = time.monotonic()
        # A handshake cut short by node 0's cap on connections (a flood at its port) fails
        # alike; one under another secret fails every time, for as long as one tries.
        return self._mismatch or (self._failed >= MISMATCHED_HANDSHAKES and
                                  time.monotonic() - self._failing_since > MISMATCHED_S)

    def _orphaned(self):
        """The launcher is gone: leave nothing behind, and no orphan."""
        try:
            if self.on_orphaned is not None:
                self.on_orphaned()
        finally:
            os._exit(3)

    def _beat(self, period):
        sock = self._connect()
        sock.setsockopt(zmq.LINGER, 0)
        seq = 0
        try:
            while not self._stop.wait(period):
                if self.watch_parent and os.getppid() != self.parent:
                    self._orphaned()
                key = self._secret
                if key is None:
                    continue  # no run key yet: nothing this sends could be heard
                seq += 1
                sock.send_multipart(seal(key, TO_COORDINATOR_DIRECTION, "HEARTBEAT",
                                         self.rank, seq, {}))
        finally:
            sock.close(0)

    def send(self, kind, payload=None, blobs=()):
        if self._secret is None:
            self._held.append((kind, payload, blobs))
            return
        self.seq += 1
        self.socket.send_multipart(seal(self._secret, TO_COORDINATOR_DIRECTION, kind,
                                        self.rank, self.seq, payload or {}, blobs))

    def _keyed(self, frames):
        """Node 0's NONCE: the run's key, then what was held. Whether ``frames`` was one."""
        if self._shared is None or len(frames) != 3 or bytes(frames[0]) != b"NONCE":
            return False
        if self._secret is None and len(frames[1]) == NONCE_BYTES:
            nonce = bytes(frames[1])
            fresh = mac(self._shared, NONCE_DIRECTION, [self._nonce, nonce])
            # Another secret's answer: keep its key anyway, so that node 0 hears this
            # node, refuses it and logs it; the node's own error says why.
            self._mismatch = not hmac.compare_digest(bytes(frames[2]), fresh)
            self._secret = run_key(self._shared, nonce)
            held, self._held = self._held, []
            for message in held:
                self.send(*message)
        return True

    def read(self):
        """The next message as (kind, payload, blobs), without waiting: None when none is
        queued, or when the one queued is not authenticated by the run's secret, not for
        this rank, or replayed (dropped)."""
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        if self._keyed(frames) or self._secret is None:
            return None
        try:
            kind, rank, seq, data, blobs = unseal(self._secret, TO_WORKER_DIRECTION, frames,
                                                  self.kinds, self.nranks)
        except Rejected:
            return None
        if rank != self.rank or seq <= self.last_received:
            return None
        self.last_received = seq
        return kind, data, blobs

    def check(self):
        """Without waiting: raise Stopped if the launcher has said STOP (Shrunk for
        SHRINK), and leave as an orphan if it is gone. Other messages are not expected
        here, and are dropped."""
        while (message := self.read()) is not None:
            if (error := _interrupting(*message[:2])) is not None:
                raise error
        if self.watch_parent and os.getppid() != self.parent:
            self._orphaned()

    def receive(self, expect, timeout=None):
        """Wait for a message of type expect; STOP raises Stopped wherever it arrives, and
        SHRINK Shrunk."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1000 if deadline is None else max(0, min(1000, (deadline - time.monotonic())
                                                             * 1000))
            if self.socket.poll(int(wait)):
                message = self.read()
                if message is None:
                    continue
                kind, data, blobs = message
                if kind == expect:
                    return data, blobs
                if (error := _interrupting(kind, data)) is not None:
                    raise error
            elif self.watch_parent and os.getppid() != self.parent:
                self._orphaned()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"rank {self.rank}: no {expect} from the launcher in "
                                   f"{timeout} s")

    def close(self):
        # What was held for want of the run's key (a failure said as the run starts) gets
        # a moment to leave.
        deadline = time.monotonic() + 2.0
        while self._held and time.monotonic() < deadline:
            if self.socket.poll(100):
                self.read()
        if self._secret is None:
            self.socket.setsockopt(zmq.LINGER, 0)  # a knock alone, to a node 0 not there
        self._stop.set()
        self._heartbeat.join(5)
        if self._monitor is not None:
            self.socket.disable_monitor()
            self._monitor.close(0)
        self.socket.close()
        self.context.term()
