"""The control plane: the launcher's coordinator (ZMQ ROUTER) and each worker's link (DEALER).

Every message is a multipart ZMQ message::

    [run token, message type, JSON payload, binary blobs...]

The coordinator binds 127.0.0.1 on a free port by default and drops (and logs) anything
whose token is not this run's, whose type is unknown, or whose payload does not parse: a
stray or malicious connection can neither join a run nor crash the coordinator.

Messages, worker to coordinator: HELLO (rank, device, pid, protocol version), REGISTER
(buffer layout, device facts; the IPC handle or shared-memory name as a blob), BARRIER (seq),
METRIC (any JSON), HEARTBEAT (sent by a thread on its own socket), ERROR (traceback), DONE
(result). Coordinator to worker: RUN, PEERS (every rank's registration), RELEASE (seq), STOP.
"""
import json
import os
import secrets
import threading
import time

import zmq

PROTOCOL_VERSION = 1

TO_COORDINATOR = {"HELLO", "REGISTER", "BARRIER", "METRIC", "HEARTBEAT", "ERROR", "DONE"}
TO_WORKER = {"RUN", "PEERS", "RELEASE", "STOP"}


class Stopped(Exception):
    """The coordinator told this worker to stop (another rank failed, or Ctrl-C)."""


def new_token():
    return secrets.token_hex(16)


def _encode(token, kind, payload, blobs=()):
    return [token.encode(), kind.encode(), json.dumps(payload).encode(), *blobs]


class BindError(OSError):
    """The coordinator cannot listen on the address asked for (a port in use, say)."""


class Coordinator:
    """The launcher's end: receives, validates and answers the workers' messages."""

    def __init__(self, nranks, host="127.0.0.1", port=None, token=None, log=None):
        self.nranks = nranks
        self.token = token or new_token()
        self.log = log or (lambda msg: None)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
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
        self.rejected = 0

    def receive(self, timeout_ms):
        """One valid message as (rank, kind, payload, blobs), or None after timeout_ms."""
        if not self.socket.poll(timeout_ms):
            return None
        frames = self.socket.recv_multipart()
        try:
            return self._parse(frames)
        except ValueError as e:
            self.rejected += 1
            self.log(f"pympgu: rejected a message on {self.address}: {e}")
            return None

    def _parse(self, frames):
        if len(frames) < 4:
            raise ValueError(f"{len(frames)} frames, expected at least 4")
        identity, token, kind, payload, *blobs = frames
        if token != self.token.encode():
            raise ValueError("wrong run token")
        kind = kind.decode("ascii", "replace")
        if kind not in TO_COORDINATOR:
            raise ValueError(f"unknown message type {kind!r}")
        try:
            data = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{kind} payload is not JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("rank"), int):
            raise ValueError(f"{kind} payload has no integer rank")
        rank = data["rank"]
        if not 0 <= rank < self.nranks:
            raise ValueError(f"{kind} from rank {rank}, outside 0..{self.nranks - 1}")
        if kind == "HELLO":
            if data.get("version") != PROTOCOL_VERSION:
                raise ValueError(f"rank {rank} speaks protocol {data.get('version')}, "
                                 f"this launcher {PROTOCOL_VERSION}")
            self.identities[rank] = identity
        elif kind != "HEARTBEAT" and self.identities.get(rank) != identity:
            raise ValueError(f"{kind} claims rank {rank} from a socket that did not say HELLO "
                             "as that rank")
        return rank, kind, data, blobs

    def send(self, rank, kind, payload=None, blobs=()):
        identity = self.identities.get(rank)
        if identity is None:
            return False
        try:
            self.socket.send_multipart([identity, *_encode(self.token, kind, payload or {}, blobs)],
                                       zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def broadcast(self, kind, payload=None, blobs=()):
        for rank in range(self.nranks):
            self.send(rank, kind, payload, blobs)

    def close(self):
        self.socket.close(0)
        self.context.term()


class WorkerLink:
    """A worker's end: requests to the coordinator, replies, and a heartbeat thread."""

    def __init__(self, address, token, rank, heartbeat_s=1.0):
        self.address, self.token, self.rank = address, token, rank
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 2000)  # let a final ERROR/DONE leave
        self.socket.connect(address)
        self.parent = os.getppid()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True)
        self._heartbeat.start()

    def _beat(self, period):
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            while not self._stop.wait(period):
                if os.getppid() != self.parent:
                    # The launcher is gone (killed outright): leave no orphan behind.
                    os._exit(3)
                sock.send_multipart(_encode(self.token, "HEARTBEAT", {"rank": self.rank}))
        finally:
            sock.close(0)

    def send(self, kind, payload=None, blobs=()):
        data = {"rank": self.rank}
        data.update(payload or {})
        self.socket.send_multipart(_encode(self.token, kind, data, blobs))

    def receive(self, expect, timeout=None):
        """Wait for a message of type expect; STOP raises Stopped wherever it arrives."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1000 if deadline is None else max(0, min(1000, (deadline - time.monotonic()) * 1000))
            if self.socket.poll(int(wait)):
                token, kind, payload, *blobs = self.socket.recv_multipart()
                if token != self.token.encode():
                    continue
                kind = kind.decode()
                data = json.loads(payload)
                if kind == "STOP":
                    raise Stopped(data.get("reason", "stopped by the launcher"))
                if kind == expect:
                    return data, blobs
            elif os.getppid() != self.parent:
                os._exit(3)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"rank {self.rank}: no {expect} from the launcher in {timeout} s")

    def close(self):
        self._stop.set()
        self._heartbeat.join(5)
        self.socket.close()
        self.context.term()
