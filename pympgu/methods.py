"""The exchange's methods, in one registry: each one's name and what it can do, and how
'auto' chooses a kernel by size. Everything that takes, checks or chooses a method reads
this module; no other compares a method's name (docs/DECISIONS.md, "Extension points").

The kernel methods are also entries of the C table in csrc/methods.cu, under the same
names, which the compiled layer checks against this one when it loads.
"""
import dataclasses

WIRES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Method:
    """One method of the exchange, and what it can do."""

    name: str
    summary: str
    kernel: bool = False       # a method of csrc/methods.cu's table (PeerGroup.allreduce)
    staged: bool = False       # needs every rank's staging area (PeerGroup's staging=True)
    limited: bool = False      # averages at most the LL limit (settings.ll_max_bytes)
    chooses: bool = False      # picks a kernel method by size
    peer_copies: bool = False  # copies into a shadow; host barriers where no peer access
    nccl: bool = False         # NCCL alone, every rank of every node in one communicator
    gathers: bool = False      # inside XLA only: the peers' arrays copied into a shadow
    shadow: bool = False       # the exchange inside the step may use the shared shadow
    selectable: bool = True    # a choice of --method and Exchanger(method=)
    wires: tuple = WIRES       # the exchange dtypes it takes

    @property
    def cpu(self):
        """Whether CPU workers take it (they average through shared memory, whatever the
        GPU's method would be)."""
        return self.chooses

    @property
    def crosses_nodes(self):
        """Whether it averages across nodes itself (the others take pympgu's hierarchy
        there, float32, which needs no shadow and no copies)."""
        return self.nccl


REGISTRY = {m.name: m for m in (
    Method("auto", "by size: ll, oneshot, then twoshot, push or ce", chooses=True,
           shadow=True),
    Method("ll", "every rank stores its values, flagged, into every peer's mailbox: small "
           "buffers", kernel=True, limited=True),
    Method("oneshot", "every rank reads every replica", kernel=True),
    Method("twoshot", "each rank reads a slice of every replica and stores its mean into "
           "all", kernel=True),
    Method("push", "two-shot by stores only", kernel=True, staged=True),
    Method("ce", "two-shot, every byte by DMA", kernel=True, staged=True),
    Method("copy", "the 2014 demo's: the peers' replicas copied into a shadow, averaged "
           "here", peer_copies=True),
    Method("nccl", "NCCL alone: the baseline, and the road without peer access", nccl=True,
           wires=("float32",)),
    Method("gather", "inside XLA: the peers' arrays reach every shadow by DMA beside the "
           "step's work", gathers=True, selectable=False),
)}
NAMES = tuple(name for name, m in REGISTRY.items() if m.selectable)
KERNELS = tuple(name for name, m in REGISTRY.items() if m.kernel)
# The kernel method a group that averages across nodes is named (its NCCL road takes no
# kernel's): one that needs no staging and no shadow.
ACROSS_NODES = "twoshot"


def get(name, choices=NAMES, what="method"):
    """The Method called ``name``, or ValueError naming ``what`` and the choices."""
    if name not in choices:
        raise ValueError(f"{what} must be one of {tuple(choices)}, got {name!r}")
    return REGISTRY[name]


def staging(name):
    """Whether a group for method ``name`` needs a staging area: True, False, or None where
    'auto' decides by the buffer's size."""
    m = REGISTRY[name]
    return None if m.chooses else m.staged


def choose(nbytes, staged, ll_max, oneshot_max, push_min, ce_min):
    """The kernel method 'auto' takes for ``nbytes`` (docs/DECISIONS.md, "Algorithm
    thresholds"): ``staged``, whether the group has a staging area."""
    if nbytes <= ll_max:
        return "ll"
    if nbytes <= oneshot_max:
        return "oneshot"
    if staged and nbytes >= ce_min:
        return "ce"
    if staged and nbytes >= push_min:
        return "push"
    return "twoshot"


def check_kernel(name, nbytes, staged, nranks, ll_limit):
    """The kernel method ``name`` for ``nbytes``, or ValueError saying why it cannot run."""
    m = get(name, KERNELS, "algo")
    if m.staged and not staged and nranks > 1:
        raise ValueError(f"algo {name!r} needs a PeerGroup made with staging=True")
    if m.limited and nbytes > ll_limit:
        raise ValueError(f"algo {name!r} averages at most {ll_limit} bytes, got {nbytes}")
    return name


def chooses(name):
    """Whether ``name`` picks its kernel by size ('auto')."""
    return name in REGISTRY and REGISTRY[name].chooses


def gathers(name):
    """Whether ``name`` is the XLA pair's gather, not a kernel's average."""
    return name in REGISTRY and REGISTRY[name].gathers


GATHER = next(name for name, m in REGISTRY.items() if m.gathers)
