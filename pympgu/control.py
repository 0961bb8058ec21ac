"""The control plane: the launcher's coordinator (ZMQ ROUTER) and each worker's link (DEALER).

Every message is a multipart ZMQ message::

    [header, JSON payload, blobs..., MAC]

The header is ``KIND RANK SEQ`` in ASCII; the MAC is an HMAC-SHA256 of the direction and
every other frame under the run's secret: 32 random bytes that the launcher hands its
workers through the spawn pipe, never through a command line, the environment or a file.
A local process that can reach the port but does not hold the secret can neither join a
run, nor speak for a rank, nor be heard at all (docs/DECISIONS.md, "Authenticated control
plane"). Each sender numbers its messages; a number not above the last one accepted from
that sender is a replay and is dropped, as is a second HELLO for a rank. Every payload is
checked against its kind's schema before anything acts on it.

Between nodes the secret is the user's, and may serve many runs: there the key is the run's
own (``fresh_key``). Each node's link KNOCKs with a nonce of its own; node 0 answers every
knock with its NONCE, fresh each run, under a MAC of both nonces; every message after is
sealed under HMAC(secret, NONCE). A message recorded in another run is refused as any
forgery is.

Rejected messages are counted and summed up in one line at most every few seconds.
Messages above MAX_MESSAGE_BYTES are refused by ZMQ itself (ZMQ_MAXMSGSIZE), which drops
the connection that sent them.

Messages, worker to coordinator: HELLO (device, pid, protocol version), REGISTER (buffer
layout, device facts; the IPC handle or shared-memory name as a blob), BARRIER (seq),
METRIC (any JSON object), HEARTBEAT (sent by a thread on its own socket), ERROR
(traceback), DONE (result). Coordinator to worker: RUN, PEERS (every rank's registration),
RELEASE (seq), STOP.
"""
import hashlib
import hmac
import json
import os
import secrets
import threading
import time

import zmq

PROTOCOL_VERSION = 3
SECRET_BYTES = 32
NONCE_BYTES = 16
# Far above any real message (a layout of thousands of tensors is a few hundred KiB), far
# below what would hurt a launcher to hold (docs/DECISIONS.md, "Authenticated control plane").
MAX_MESSAGE_BYTES = 16 << 20
REJECT_SUMMARY_S = 5.0  # at most one line about rejected messages this often

TO_COORDINATOR = {"HELLO", "REGISTER", "BARRIER", "METRIC", "HEARTBEAT", "ERROR", "DONE"}
TO_WORKER = {"RUN", "PEERS", "RELEASE", "STOP"}
# Between node launchers and node 0's (a run of several nodes): the same protocol, one
# level up. A node JOINs, ARRIVEs at each run-wide barrier once all its ranks have, passes
# its ranks' METRICs on (REPORT), says when one FAILed, and FINISHes with its results.
TO_HUB = {"JOIN", "ARRIVE", "REPORT", "FAIL", "FINISH", "HEARTBEAT"}
TO_NODE = {"START", "RELEASE", "STOP", "HEARTBEAT"}

_ANY = object()
# kind -> (required fields and their types, blobs allowed, other fields allowed)
_SCHEMA = {
    "HELLO": ({"version": int, "pid": int, "device": (int, type(None))}, 0, False),
    "REGISTER": ({"layout": list, "facts": dict}, 1, False),
    "BARRIER": ({"seq": int, "what": (str, type(None)), "value": _ANY, "shared": _ANY,
                 "local": bool, "gather": bool}, 0, False),
    "METRIC": ({}, 0, True),
    "HEARTBEAT": ({}, 0, False),
    "ERROR": ({"traceback": str}, 0, False),
    "DONE": ({"result": _ANY}, 0, False),
    "RUN": ({}, 0, False),
    "PEERS": ({"facts": list, "max_blocks": (int, type(None))}, 8, False),
    "RELEASE": ({"seq": int, "shared": _ANY, "values": (list, type(None))}, 0, False),
    "STOP": ({"reason": str}, 0, False),
    "JOIN": ({"version": int, "pid": int, "host": str, "nlocal": int}, 0, False),
    "ARRIVE": ({"seq": int, "what": (str, type(None)), "value": _ANY, "shared": _ANY,
                "values": (list, type(None))}, 0, False),
    "REPORT": ({"rank": int, "data": dict}, 0, False),
    "FAIL": ({"rank": (int, type(None)), "reason": str, "details": str}, 0, False),
    "FINISH": ({"results": list}, 0, False),
    "START": ({}, 0, False),
}
_TO_COORDINATOR, _TO_WORKER = b"C", b"W"  # the direction, under the MAC
_NONCE = b"N"  # node 0's answer to a knock, under the MAC of the nodes' secret


class Stopped(Exception):
    """The coordinator told this worker to stop (another rank failed, or Ctrl-C)."""


class BindError(OSError):
    """The coordinator cannot listen on the address asked for (a port in use, say)."""


class Rejected(ValueError):
    """A message that is not this run's, or not well formed; it is dropped and counted."""


def new_secret():
    """A run's secret: never printed, never in a name, a command line or a file."""
    return secrets.token_bytes(SECRET_BYTES)


def new_run_id():
    """A run's public name, for its shared-memory segments: random, and no key to anything."""
    return secrets.token_hex(8)


def printable(text, limit=20000):
    """``text`` as it may reach a terminal: control characters (escape sequences above all)
    shown as ``\\xNN``, newlines and tabs kept; at most ``limit`` characters."""
    text = str(text)
    if len(text) > limit:
        text = text[:limit] + f"... ({len(text) - limit} more characters)"
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}"
                   if ord(c) < 256 else f"\\u{ord(c):04x}" for c in text)


def run_key(secret, nonce):
    """The key of one run of several nodes: their shared secret and node 0's nonce."""
    return hmac.new(secret, b"pympgu run key " + nonce, hashlib.sha256).digest()


def _mac(secret, direction, frames):
    h = hmac.new(secret, direction, hashlib.sha256)
    for f in frames:
        h.update(len(f).to_bytes(8, "little"))
        h.update(f)
    return h.digest()


def seal(secret, direction, kind, rank, seq, payload, blobs=()):
    """The frames of one message, authenticated."""
    frames = [f"{kind} {rank} {seq}".encode(), json.dumps(payload).encode(),
              *(bytes(b) for b in blobs)]
    return frames + [_mac(secret, direction, frames)]


def unseal(secret, direction, frames, kinds, nranks):
    """(kind, rank, seq, payload, blobs) of an authenticated, well-formed message, or
    Rejected saying why not. The MAC is checked before anything in the frames is read."""
    if not 3 <= len(frames) <= 3 + 8:
        raise Rejected(f"{len(frames)} frames")
    *body, mac = frames
    if not hmac.compare_digest(bytes(mac), _mac(secret, direction, body)):
        raise Rejected("not authenticated by the run's secret")
    header, payload, *blobs = body
    try:
        kind, rank, seq = header.decode("ascii").split(" ")
        rank, seq = int(rank), int(seq)
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise Rejected(f"malformed ({e})") from None
    if kind not in kinds:
        raise Rejected(f"unknown message type {kind!r}")
    if not 0 <= rank < nranks:
        raise Rejected(f"{kind} for rank {rank}, outside 0..{nranks - 1}")
    _check(kind, data, blobs)
    return kind, rank, seq, data, blobs


def _check(kind, data, blobs):
    fields, nblobs, extra = _SCHEMA[kind]
    if not isinstance(data, dict):
        raise Rejected(f"{kind} payload is not an object")
    if len(blobs) > nblobs:
        raise Rejected(f"{kind} with {len(blobs)} blobs")
    for key, types in fields.items():
        if key not in data:
            raise Rejected(f"{kind} has no {key!r}")
        if types is not _ANY and not isinstance(data[key], types):
            raise Rejected(f"{kind}'s {key!r} is a {type(data[key]).__name__}")
    if not extra and len(data) != len(fields):
        raise Rejected(f"{kind} has unknown fields {sorted(set(data) - set(fields))}")
    if kind == "REGISTER" and not all(
            isinstance(t, list) and len(t) == 3 and isinstance(t[0], str)
            and isinstance(t[1], list) and all(isinstance(d, int) for d in t[1])
            and isinstance(t[2], str) for t in data["layout"]):
        raise Rejected("REGISTER's layout is not a list of (name, shape, dtype)")


class Coordinator:
    """The launcher's end: receives, authenticates, validates and answers the workers'
    messages. ``secret`` is the run's (new_secret); ``log`` takes the summary lines of
    rejected messages. With ``fresh_key`` (node 0 of several) ``secret`` is the nodes'
    and the messages are sealed under this run's key, which knocking links learn."""

    def __init__(self, nranks, host="127.0.0.1", port=None, secret=None, log=None,
                 kinds=TO_COORDINATOR, hello="HELLO", fresh_key=False):
        self.nranks = nranks
        self.kinds, self.hello = kinds, hello
        self.secret = secret or new_secret()
        self._shared = self.nonce = None
        if fresh_key:
            self._shared, self.nonce = self.secret, secrets.token_bytes(NONCE_BYTES)
            self.secret = run_key(self._shared, self.nonce)
        self.log = log or (lambda msg: None)
        self.rejected = 0
        self._unreported, self._last_reason, self._reported_at = 0, "", 0.0
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # A worker that died and restarted must not leave messages queued for a dead peer.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if port:
                self.socket.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self.close()
            raise BindError(e.errno, os.strerror(e.errno), f"tcp://{host}:{port or '*'}") \
                from None
        self.address = f"tcp://{host}:{self.port}"
        self.identities = {}  # rank -> ZMQ identity of its main socket
        self.last_seq = {}  # (rank, heartbeat?) -> the last sequence number accepted
        self.sent_seq = [0] * nranks

    def receive(self, timeout_ms):
        """One valid message as (rank, kind, payload, blobs), or None after timeout_ms."""
        self._summarize()
        if not self.socket.poll(timeout_ms):
            return None
        frames = self.socket.recv_multipart(copy=True)
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
        if self._shared is not None and frames[:1] == [b"KNOCK"]:
            return self._answer(identity, frames)
        kind, rank, seq, data, blobs = unseal(self.secret, _TO_COORDINATOR, frames,
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

    def _answer(self, identity, frames):
        """Node 0's NONCE to a knock: anyone may have it, only a holder of the secret can
        seal with the key it gives, and the knocker checks that it is fresh."""
        if len(frames) != 2 or len(frames[1]) != NONCE_BYTES:
            raise Rejected("a malformed KNOCK")
        answer = [b"NONCE", self.nonce]
        try:
            self.socket.send_multipart(
                [identity, *answer, _mac(self._shared, _NONCE, [frames[1], self.nonce])],
                zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        return None

    def _summarize(self, force=False):
        now = time.monotonic()
        if self._unreported and (force or now - self._reported_at >= REJECT_SUMMARY_S):
            self.log(f"pympgu: rejected {self._unreported} message(s) on {self.address} "
                     f"({self.rejected} in all; the last: {printable(self._last_reason, 200)})")
            self._unreported, self._reported_at = 0, now

    def send(self, rank, kind, payload=None, blobs=()):
        identity = self.identities.get(rank)
        if identity is None:
            return False
        self.sent_seq[rank] += 1
        frames = seal(self.secret, _TO_WORKER, kind, rank, self.sent_seq[rank], payload or {},
                      blobs)
        try:
            self.socket.send_multipart([identity, *frames], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def broadcast(self, kind, payload=None, blobs=()):
        for rank in range(self.nranks):
            self.send(rank, kind, payload, blobs)

    def close(self):
        self._summarize(force=True)
        self.socket.close(0)
        self.context.term()


class WorkerLink:
    """A worker's end: requests to the coordinator, replies, and a heartbeat thread.

    ``on_orphaned`` runs when the launcher is found gone (killed outright), just before
    this process exits: what it created that would outlive it is removed there.

    With ``fresh_key`` (a node's link to node 0) ``secret`` is the nodes': the link knocks,
    and holds what it sends until node 0's NONCE gives the run's key. ``secret_mismatch``
    says that node 0 answered under another secret."""

    def __init__(self, address, secret, rank, nranks, heartbeat_s=1.0, on_orphaned=None,
                 kinds=TO_WORKER, watch_parent=True, fresh_key=False):
        self.address, self.rank, self.nranks = address, rank, nranks
        self._secret = secret
        self._shared = self._nonce = None
        self._held = []  # what was sent before the run's key was known
        self.secret_mismatch = False
        self.kinds = kinds
        self.on_orphaned = on_orphaned
        self.watch_parent = watch_parent
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 2000)  # let a final ERROR/DONE leave
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.socket.connect(address)
        if fresh_key:
            self._shared, self._secret = secret, None
            self._nonce = secrets.token_bytes(NONCE_BYTES)
            self.socket.send_multipart([b"KNOCK", self._nonce])
        self.parent = os.getppid()
        self.seq = 0
        self.last_received = 0
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True)
        self._heartbeat.start()

    def _orphaned(self):
        """The launcher is gone: leave nothing behind, and no orphan."""
        try:
            if self.on_orphaned is not None:
                self.on_orphaned()
        finally:
            os._exit(3)

    def _beat(self, period):
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        seq = 0
        try:
            while not self._stop.wait(period):
                if self.watch_parent and os.getppid() != self.parent:
                    self._orphaned()
                key = self._secret
                if key is None:
                    continue  # no run key yet: nothing this sends could be heard
                seq += 1
                sock.send_multipart(seal(key, _TO_COORDINATOR, "HEARTBEAT", self.rank, seq, {}))
        finally:
            sock.close(0)

    def send(self, kind, payload=None, blobs=()):
        if self._secret is None:
            self._held.append((kind, payload, blobs))
            return
        self.seq += 1
        self.socket.send_multipart(seal(self._secret, _TO_COORDINATOR, kind, self.rank, self.seq,
                                        payload or {}, blobs))

    def _keyed(self, frames):
        """Node 0's NONCE: the run's key, then what was held. Whether ``frames`` was one."""
        if self._shared is None or frames[:1] != [b"NONCE"]:
            return False
        if self._secret is None and len(frames) == 3 and len(frames[1]) == NONCE_BYTES:
            fresh = _mac(self._shared, _NONCE, [self._nonce, bytes(frames[1])])
            # Another secret's answer: keep its key anyway, so that node 0 hears this
            # node, refuses it and logs it; the node's own error says why.
            self.secret_mismatch = not hmac.compare_digest(bytes(frames[2]), fresh)
            self._secret = run_key(self._shared, bytes(frames[1]))
            held, self._held = self._held, []
            for message in held:
                self.send(*message)
        return True

    def read(self):
        """The next message as (kind, payload, blobs), without waiting: None when none is
        queued, or when the one queued is not authenticated by the run's secret, not for
        this rank, or replayed (dropped)."""
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        if self._keyed(frames) or self._secret is None:
            return None
        try:
            kind, rank, seq, data, blobs = unseal(self._secret, _TO_WORKER, frames, self.kinds,
                                                  self.nranks)
        except Rejected:
            return None
        if rank != self.rank or seq <= self.last_received:
            return None
        self.last_received = seq
        return kind, data, blobs

    def receive(self, expect, timeout=None):
        """Wait for a message of type expect; STOP raises Stopped wherever it arrives."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1000 if deadline is None else max(0, min(1000, (deadline - time.monotonic()) * 1000))
            if self.socket.poll(int(wait)):
                message = self.read()
                if message is None:
                    continue
                kind, data, blobs = message
                if kind == "STOP":
                    raise Stopped(data["reason"])
                if kind == expect:
                    return data, blobs
            elif self.watch_parent and os.getppid() != self.parent:
                self._orphaned()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"rank {self.rank}: no {expect} from the launcher in {timeout} s")

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
        self.socket.close()
        self.context.term()
