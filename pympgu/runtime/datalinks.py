"""Authenticated TCP links between CPU workers of different nodes: the data plane that
pympgu.exchange.across sums over (docs/DECISIONS.md, "CPU workers across nodes").

Each rank listens on its node's address (the interface toward node 0); every rank learns the
others' addresses, and one key that rank 0 draws, through the control plane (encrypted
between nodes). A link is one TCP connection, dialled by the rank of the later node and
kept once both ends proved that they hold the key (HMAC-SHA256 over both ends' ranks and
nonces). A connection that does not prove it within HANDSHAKE_S is closed without delaying
the others: a stranger can neither join the run nor stall or crash it. The listening socket
closes once every link is up. The data itself is not encrypted, as gloo's and NCCL's is not.
"""
import hashlib
import hmac
import secrets
import selectors
import socket
import struct
import time

import numpy as np

MAGIC = b"pympgu data 1\n"
NONCE_BYTES, MAC_BYTES = 16, 32
HELLO = struct.Struct("!I")  # the dialling rank, after MAGIC and before its nonce
FRAME = struct.Struct("!Q")  # a payload's length, before it
HANDSHAKE_S = 5.0
# Connections admitted and not yet proven, at most: past it the oldest is closed, so that a
# flood can neither take a worker's descriptors nor keep a real peer waiting (a real peer
# proves itself within a round trip, and is never the oldest for long).
MAX_UNPROVEN = 32
SLICE_S = 0.02  # a wait looks for the launcher's STOP this often


class LinkLost(ConnectionError):
    """A peer's link closed or failed: its rank and node are named."""

    def __init__(self, rank, node, why):
        super().__init__(f"rank {rank} (node {node}) {why}")
        self.rank, self.node = rank, node


def local_address(toward):
    """This host's address on the interface that routes toward ``toward`` (node 0's host)."""
    family, _, _, _, where = socket.getaddrinfo(toward, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(where)  # a datagram socket's connect sends nothing: it picks the route
        return s.getsockname()[0]


def _why(error):
    if isinstance(error, (BrokenPipeError, ConnectionResetError)):
        return "closed its link"
    return f"failed ({error.strerror or error})"


def _mac(key, label, dialler, acceptor, nonces):
    return hmac.new(key, label + HELLO.pack(dialler) + HELLO.pack(acceptor) + nonces,
                    hashlib.sha256).digest()


class DataLinks:
    """This rank's links to ``peers`` (global ranks on other nodes), made by ``connect``.

    ``allgather(payload)`` hands every peer this rank's bytes and returns theirs;
    ``exchange`` sends to and receives from the peers it names (a ring's step); a wait
    calls ``check`` every SLICE_S (the launcher's STOP raises there) and a peer that closes
    its link raises LinkLost."""

    def __init__(self, rank, sockets, node_of, check, silence=600.0):
        self.rank, self.sockets, self.node_of, self.check = rank, sockets, node_of, check
        self.silence = silence  # a wait with nothing moving this long names the peer hung
        self.selector = selectors.DefaultSelector()
        for peer, s in sockets.items():
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def connect(cls, ctx, peers, timeout=60.0):
        """Every rank of the run calls this at once (a run-wide gather of addresses)."""
        host = local_address(ctx.data_address or "127.0.0.1")
        listener = socket.create_server((host, 0), family=socket.getaddrinfo(
            host, 0)[0][0], backlog=64)
        try:
            mine = {"address": list(listener.getsockname()[:2]),
                    "key": secrets.token_hex(32) if ctx.rank == 0 else None}
            every = ctx.gather(mine)
            key = bytes.fromhex(every[0]["key"])
            addresses = {p: tuple(every[p]["address"]) for p in peers}
            node_of = lambda r: r // ctx.local_nranks  # noqa: E731 (ranks go node by node)
            sockets = _Handshakes(ctx.rank, key, listener, addresses, node_of, ctx.check,
                                  timeout).run()
        finally:
            listener.close()
        return cls(ctx.rank, sockets, node_of, ctx.check, ctx.progress_timeout)

    def allgather(self, payload, check=None):
        """``payload`` (bytes-like) to every peer; every peer's, as {rank: numpy uint8
        array}. Every peer's payload has the same length as this rank's."""
        n = memoryview(payload).nbytes
        return self.exchange(dict.fromkeys(self.sockets, payload),
                             dict.fromkeys(self.sockets, n), check)

    def exchange(self, sends, receives, check=None):
        """At once: ``sends[peer]`` (bytes-like) to each peer named there, and from each
        peer in ``receives`` its message of ``receives[peer]`` bytes, returned as {peer:
        numpy uint8 array}. Each message carries its length: a peer out of step is named.
        ``check`` replaces the links' own while this waits (another thread's: the
        launcher's socket is the main thread's alone)."""
        out = {}
        for p, payload in sends.items():
            view = memoryview(payload).cast("B")
            out[p] = [memoryview(FRAME.pack(view.nbytes)), view]
        got = {p: np.empty(n, np.uint8) for p, n in receives.items()}
        heads = {p: [bytearray(FRAME.size), 0] for p in receives}
        filled = dict.fromkeys(receives, 0)
        pending_out, pending_in = set(sends), set(receives)
        moved = time.monotonic()
        while pending_out or pending_in:
            progress = False
            for p in list(pending_out):
                progress |= self._send(p, out[p], pending_out)
            for p in list(pending_in):
                progress |= self._receive(p, receives[p], heads[p], got[p], filled, pending_in)
            if progress or not (pending_out or pending_in):
                moved = time.monotonic()
                continue
            if time.monotonic() - moved > self.silence:
                peer = min(pending_in or pending_out)
                raise self._lost(peer, f"moved nothing for {self.silence:g} s while rank "
                                       f"{self.rank} waited for it (hung?)")
            self._wait(pending_out, pending_in, check or self.check)
        return got

    def _send(self, peer, parts, pending):
        s, moved = self.sockets[peer], False
        while parts:
            if not parts[0].nbytes:
                parts.pop(0)
                continue
            try:
                sent = s.send(parts[0])
            except BlockingIOError:
                return moved
            except OSError as e:
                raise self._lost(peer, _why(e)) from None
            parts[0] = parts[0][sent:]
            moved = True
        pending.discard(peer)
        return moved

    def _receive(self, peer, n, head, into, filled, pending):
        moved = False
        while head[1] < FRAME.size:  # the length first
            k = self._recv_into(peer, memoryview(head[0])[head[1]:])
            if not k:
                return moved
            head[1] += k
            moved = True
        if FRAME.unpack(head[0])[0] != n:
            raise self._lost(peer, f"sent {FRAME.unpack(head[0])[0]} bytes where this rank "
                                   f"expected {n} (out of step)")
        view = memoryview(into)
        while filled[peer] < n:
            k = self._recv_into(peer, view[filled[peer]:])
            if not k:
                return moved
            filled[peer] += k
            moved = True
        pending.discard(peer)
        return moved

    def _recv_into(self, peer, view):
        """The bytes read into ``view`` now (0: none yet); a closed or failed link raises."""
        try:
            k = self.sockets[peer].recv_into(view)
        except BlockingIOError:
            return 0
        except OSError as e:
            raise self._lost(peer, _why(e)) from None
        if not k:
            raise self._lost(peer, "closed its link")
        return k

    def _wait(self, pending_out, pending_in, check):
        for p in pending_out | pending_in:
            events = ((selectors.EVENT_WRITE if p in pending_out else 0)
                      | (selectors.EVENT_READ if p in pending_in else 0))
            self.selector.register(self.sockets[p], events)
        try:
            self.selector.select(SLICE_S)
        finally:
            for p in pending_out | pending_in:
                self.selector.unregister(self.sockets[p])
        check()

    def _lost(self, peer, why):
        return LinkLost(peer, self.node_of(peer), why)

    def close(self):
        for s in self.sockets.values():
            s.close()
        self.sockets = {}
        self.selector.close()


class _Handshakes:
    """Dial the peers of earlier nodes, admit those of later ones, concurrently: a
    connection that does not prove the key within HANDSHAKE_S is dropped alone."""

    def __init__(self, rank, key, listener, addresses, node_of, check, timeout):
        self.rank, self.key, self.listener = rank, key, listener
        self.addresses, self.node_of, self.check = addresses, node_of, check
        self.deadline = time.monotonic() + timeout
        self.node = node_of(rank)
        self.expected = {p for p in addresses if node_of(p) > self.node}
        self.links = {}
        self.pending = {}  # socket -> [role, peer, nonce, what was read, deadline]
        self.selector = selectors.DefaultSelector()

    def run(self):
        listener = self.listener
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ)
        try:
            for p in sorted(self.addresses):
                if self.node_of(p) < self.node:
                    self._dial(p)
            while len(self.links) < len(self.addresses):
                now = time.monotonic()
                if now > self.deadline:
                    missing = sorted(set(self.addresses) - set(self.links))
                    raise LinkLost(missing[0], self.node_of(missing[0]),
                                   f"made no data link with rank {self.rank} in time (its "
                                   f"node's address {self.addresses[missing[0]][0]} "
                                   "unreachable from here? a firewall?)")
                for s, state in list(self.pending.items()):
                    if now > state[4]:
                        self._drop(s)
                for key, _ in self.selector.select(SLICE_S):
                    if key.fileobj is listener:
                        self._admit()
                    else:
                        self._advance(key.fileobj)
                self.check()
        except BaseException:
            for s in self.links.values():
                s.close()
            raise
        finally:
            for s in self.pending:  # strangers' connections, and a failure's half-made links
                s.close()
            self.selector.close()
        return self.links

    def _dial(self, peer):
        """Connect to ``peer`` and say hello; again and again until the deadline, while its
        port is busy (a flood fills its backlog, or closes this connection unproven)."""
        while True:
            try:
                s = socket.create_connection(self.addresses[peer], timeout=1.0)
                break
            except OSError as e:
                if time.monotonic() > self.deadline:
                    raise LinkLost(peer, self.node_of(peer), f"took no data link from rank "
                                   f"{self.rank} in time ({e.strerror or e})") from None
                self.check()
                time.sleep(SLICE_S)
        nonce = secrets.token_bytes(NONCE_BYTES)
        s.sendall(MAGIC + HELLO.pack(self.rank) + nonce)
        s.setblocking(False)
        self.pending[s] = ["dial", peer, nonce, b"", time.monotonic() + HANDSHAKE_S]
        self.selector.register(s, selectors.EVENT_READ)

    def _admit(self):
        try:
            s, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        s.setblocking(False)
        admitted = [c for c, state in self.pending.items() if state[0] == "admit"]
        if len(admitted) >= MAX_UNPROVEN:
            # The oldest that has not said who it is (a peer's hello comes with its
            # connection), else the oldest: dicts keep their order of insertion.
            silent = [c for c in admitted if self.pending[c][1] is None]
            self._drop((silent or admitted)[0])
        self.pending[s] = ["admit", None, None, b"", time.monotonic() + HANDSHAKE_S]
        self.selector.register(s, selectors.EVENT_READ)
        self._advance(s)  # its hello, where it is already there

    def _advance(self, s):
        state = self.pending.get(s)
        if state is None:
            return
        role, peer, nonce, got, _ = state
        want = (NONCE_BYTES + MAC_BYTES if role == "dial"
                else len(MAGIC) + HELLO.size + NONCE_BYTES if peer is None else MAC_BYTES)
        try:
            chunk = s.recv(want - len(got))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(s)
            if role == "dial":  # closed unproven by a flooded peer: once more
                self._dial(peer)
            return
        got = state[3] = got + chunk
        if len(got) < want:
            return
        state[3] = b""
        if role == "dial":  # the peer's nonce and proof; then this rank's proof
            nonces = nonce + got[:NONCE_BYTES]
            if not hmac.compare_digest(got[NONCE_BYTES:],
                                       _mac(self.key, b"admit", self.rank, peer, nonces)):
                raise LinkLost(peer, self.node_of(peer), "answered at its address without "
                               "the run's key (another process holds its port?)")
            s.setblocking(True)
            s.sendall(_mac(self.key, b"dial", self.rank, peer, nonces))
            self._keep(s, peer)
        elif peer is None:  # a dialler's hello: who, and its nonce
            (who,) = HELLO.unpack(got[len(MAGIC):len(MAGIC) + HELLO.size])
            if got[:len(MAGIC)] != MAGIC or who not in self.expected or who in self.links:
                return self._drop(s)
            mine = secrets.token_bytes(NONCE_BYTES)
            state[1], state[2] = who, got[-NONCE_BYTES:] + mine
            try:
                s.send(mine + _mac(self.key, b"admit", who, self.rank, state[2]))
            except OSError:
                return self._drop(s)
        else:  # the dialler's proof
            if not hmac.compare_digest(got, _mac(self.key, b"dial", peer, self.rank, nonce)):
                return self._drop(s)
            if peer in self.links:
                return self._drop(s)
            self._keep(s, peer)

    def _keep(self, s, peer):
        self.selector.unregister(s)
        del self.pending[s]
        self.links[peer] = s

    def _drop(self, s):
        self.selector.unregister(s)
        del self.pending[s]
        s.close()
