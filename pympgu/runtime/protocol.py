"""The control plane's messages: their kinds, schemas and sizes, sealed and opened.

Every message is a multipart ZMQ message::

    [header, JSON payload, blobs..., MAC]

The header is ``KIND RANK SEQ`` in ASCII; the MAC is an HMAC-SHA256 of the direction and
every other frame under the run's key (docs/DECISIONS.md, "Authenticated control plane").
Each kind has a schema, and a most frames and bytes that it can hold: a message beyond them
is refused before its MAC is computed, so that no one, holder of the key or not, can make a
launcher hash or hold more than its kind needs.

Worker to coordinator: HELLO (device, pid, protocol version), REGISTER (buffer layout,
device facts; the IPC handle or shared-memory name as a blob), BARRIER (seq), WAITING (at a
barrier in shared memory, for long, or no longer), METRIC (any JSON object), HEARTBEAT (sent
by a thread on its own socket), ERROR (traceback, or a message that says it all), RECOVER
(after a SHRINK: the exchanges this rank completed last), DONE (result). Coordinator to
worker: RUN (whether it joins a run under way, and whether it keeps its state where a
worker in its place finds it), PEERS (every rank's registration), RELEASE (seq), STOP,
SHRINK (a rank was lost, or a restarted one joins: stop where you are), REFORM (the workers from now on, the
exchange they all go back to, the rank a joiner takes the state from, the worker's node
and the nodes' number, and the node whose state a node that joins late takes). Between node launchers and node 0's: JOIN, ARRIVE, REPORT, FAIL,
FINISH, HOLD (after a DROP: the exchanges every worker of the node holds), PAUSE (a worker
of the node lost, its replacement starting, and the ranks whose workers are new) and HEARTBEAT up; START, RELEASE, STOP, DROP (a
node was dropped, one waits for a replacement or one joins: every worker goes back),
REGROUP (the nodes from now on, where they go back to, whose state a joining node takes),
END (a loss came after the run's last barrier: finish with what the workers give) and
HEARTBEAT down; START says whether the node joins a run under way. ARRIVE, DROP, HOLD, PAUSE
and REGROUP carry the membership's generation: what an earlier one sent is dropped.
"""
import hashlib
import hmac
import json
import secrets

PROTOCOL_VERSION = 11
SECRET_BYTES = 32
NONCE_BYTES = 16
# A frame's most bytes (ZMQ_MAXMSGSIZE): far above any real message (a layout of thousands
# of tensors is a few hundred KiB), far below what would hurt a launcher to hold.
MAX_FRAME_BYTES = 16 << 20
MAX_BLOB_BYTES = 4096  # an IPC handle is 64 bytes, a segment's name under 100
MAX_HEADER_BYTES = 64

TO_COORDINATOR = {"HELLO", "REGISTER", "BARRIER", "WAITING", "METRIC", "HEARTBEAT", "ERROR",
                  "RECOVER", "DONE"}
TO_WORKER = {"RUN", "PEERS", "RELEASE", "STOP", "SHRINK", "REFORM"}
TO_HUB = {"JOIN", "ARRIVE", "REPORT", "FAIL", "FINISH", "HOLD", "PAUSE", "HEARTBEAT"}
TO_NODE = {"START", "RELEASE", "STOP", "DROP", "REGROUP", "END", "HEARTBEAT"}

ANY = object()
_NONE = type(None)
_SMALL, _TEXT, _BIG = 4 << 10, 1 << 20, MAX_FRAME_BYTES
# kind -> (required fields and their types, blobs allowed, other fields allowed, the most
# bytes of its header, payload and blobs together)
SCHEMA = {
    "HELLO": ({"version": int, "pid": int, "device": (int, _NONE)}, 0, False, _SMALL),
    "REGISTER": ({"layout": list, "facts": dict}, 1, False, _BIG),
    "BARRIER": ({"seq": int, "what": (str, _NONE), "value": ANY, "shared": ANY,
                 "local": bool, "gather": bool}, 0, False, _BIG),
    "WAITING": ({"waiting": bool}, 0, False, _SMALL),
    "METRIC": ({}, 0, True, _TEXT),
    "HEARTBEAT": ({}, 0, False, _SMALL),
    "ERROR": ({"traceback": str, "message": (str, _NONE)}, 0, False, 2 * _TEXT),
    "RECOVER": ({"kept": list, "at": (list, _NONE)}, 0, False, _SMALL),
    "END": ({"reason": str}, 0, False, _TEXT),
    "DONE": ({"result": ANY}, 0, False, _BIG),
    "RUN": ({"joining": bool, "carry": bool}, 0, False, _SMALL),
    "PEERS": ({"facts": list, "max_blocks": (int, _NONE)}, 8, False, _BIG),
    "RELEASE": ({"seq": int, "shared": ANY, "values": (list, _NONE)}, 0, False, _BIG),
    "STOP": ({"reason": str}, 0, False, _TEXT),
    "SHRINK": ({"lost": (int, _NONE), "reason": str}, 0, False, _TEXT),
    "REFORM": ({"members": list, "back_to": list, "root": (int, _NONE), "node": int,
                "nnodes": int, "source": (int, _NONE), "keeper": (int, _NONE)}, 0, False,
               _SMALL),
    "JOIN": ({"version": int, "pid": int, "host": str, "nlocal": int}, 0, False, _SMALL),
    "ARRIVE": ({"seq": int, "what": (str, _NONE), "value": ANY, "shared": ANY,
                "values": (list, _NONE), "gen": int}, 0, False, _BIG),
    "REPORT": ({"rank": int, "data": dict}, 0, False, _TEXT),
    "FAIL": ({"rank": (int, _NONE), "reason": str, "details": str}, 0, False, _TEXT),
    "FINISH": ({"results": list}, 0, False, _BIG),
    "START": ({"gen": int, "joining": bool}, 0, False, _SMALL),
    "HOLD": ({"gen": int, "kept": list, "at": (list, _NONE), "fresh": bool}, 0, False,
             _SMALL),
    "PAUSE": ({"gen": int, "rank": int, "joined": list, "reason": str}, 0, False, _TEXT),
    "DROP": ({"gen": int, "reason": str, "node": (int, _NONE)}, 0, False, _TEXT),
    "REGROUP": ({"gen": int, "back_to": list, "nodes": list, "source": (int, _NONE),
                 "keeper": (int, _NONE)}, 0, False, _SMALL),
}
TO_COORDINATOR_DIRECTION, TO_WORKER_DIRECTION = b"C", b"W"  # under the MAC
NONCE_DIRECTION = b"N"  # node 0's answer to a knock, under the MAC of the nodes' secret


class Rejected(ValueError):
    """A message that is not this run's, or not well formed; it is dropped and counted."""


def new_secret():
    """A run's secret: never printed, never in a name, a command line or a file."""
    return secrets.token_bytes(SECRET_BYTES)


def new_run_id():
    """A run's public name, for its shared-memory segments: random, and no key to anything."""
    return secrets.token_hex(8)


def run_key(secret, nonce):
    """The key of one run of several nodes: their shared secret and node 0's nonce."""
    return hmac.new(secret, b"pympgu run key " + nonce, hashlib.sha256).digest()


def printable(text, limit=20000):
    """``text`` as it may reach a terminal: control characters (escape sequences above all)
    shown as ``\\xNN``, newlines and tabs kept; at most ``limit`` characters."""
    text = str(text)
    if len(text) > limit:
        text = text[:limit] + f"... ({len(text) - limit} more characters)"
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}"
                   if ord(c) < 256 else f"\\u{ord(c):04x}" for c in text)


def mac(secret, direction, frames):
    h = hmac.new(secret, direction, hashlib.sha256)
    for f in frames:
        h.update(len(f).to_bytes(8, "little"))
        h.update(f)
    return h.digest()


def seal(secret, direction, kind, rank, seq, payload, blobs=()):
    """The frames of one message, authenticated."""
    frames = [f"{kind} {rank} {seq}".encode(), json.dumps(payload).encode(),
              *(bytes(b) for b in blobs)]
    return frames + [mac(secret, direction, frames)]


def _size_check(frames, kinds):
    """Refuse, before anything is hashed or copied, a message whose frames its kind cannot
    hold (``frames``: bytes or ZMQ frames, read by length alone but for the header)."""
    if not 3 <= len(frames) <= 3 + 8 or len(frames[0]) > MAX_HEADER_BYTES:
        raise Rejected(f"{len(frames)} frames")
    kind = bytes(frames[0]).split(b" ", 1)[0].decode("ascii", "replace")
    if kind not in kinds:
        raise Rejected(f"unknown message type {printable(kind, 40)!r}")
    _, nblobs, _, most = SCHEMA[kind]
    if len(frames) > 3 + nblobs:
        raise Rejected(f"{kind} with {len(frames) - 3} blobs")
    if any(len(b) > MAX_BLOB_BYTES for b in frames[2:-1]):
        raise Rejected(f"{kind} with a blob above {MAX_BLOB_BYTES} bytes")
    size = sum(len(f) for f in frames[:-1])
    if size > most:
        raise Rejected(f"{kind} of {size} bytes, above the {most} it may hold")


def unseal(secret, direction, frames, kinds, nranks):
    """(kind, rank, seq, payload, blobs) of an authenticated, well-formed message, or
    Rejected saying why not. Sizes are checked before the MAC, the MAC before anything in
    the frames is parsed."""
    _size_check(frames, kinds)
    *body, tag = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    if not hmac.compare_digest(bytes(tag), mac(secret, direction, body)):
        raise Rejected("not authenticated by the run's secret")
    header, payload, *blobs = (bytes(f) for f in body)
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
    fields, nblobs, extra, _ = SCHEMA[kind]
    if not isinstance(data, dict):
        raise Rejected(f"{kind} payload is not an object")
    if len(blobs) > nblobs:
        raise Rejected(f"{kind} with {len(blobs)} blobs")
    for key, types in fields.items():
        if key not in data:
            raise Rejected(f"{kind} has no {key!r}")
        if types is not ANY and not isinstance(data[key], types):
            raise Rejected(f"{kind}'s {key!r} is a {type(data[key]).__name__}")
    if not extra and len(data) != len(fields):
        raise Rejected(f"{kind} has unknown fields {sorted(set(data) - set(fields))}")
    if kind == "REGISTER" and not all(
            isinstance(t, list) and len(t) == 3 and isinstance(t[0], str)
            and isinstance(t[1], list) and all(isinstance(d, int) for d in t[1])
            and isinstance(t[2], str) for t in data["layout"]):
        raise Rejected("REGISTER's layout is not a list of (name, shape, dtype)")
