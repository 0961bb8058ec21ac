"""A training run's configuration: typed, frozen, checked once, and saved as config.json.

``RunConfig`` holds what ``python -m pympgu.train``'s flags say (pympgu.training.cli turns
the flags into one), what every worker is given, and what pympgu.evaluate rebuilds the
model from. Its checks raise :class:`UsageError` naming the flag at fault.
"""
import dataclasses
import importlib.util
import json

from .. import methods
from ..errors import FlagError
from ..exchange import outer
from ..models import OPTIMIZERS, STATISTICS_EXAMPLES
from ..precision import DTYPES as COMPUTE_DTYPES
from ..schedule import SCHEDULES

BACKENDS = ("jax", "c")
# --across-nodes: how nodes meet (docs/TRAINING.md, "Across slow links").
ACROSS_NODES = ("every-step", "average") + outer.NAMES
OUTER_DTYPES = ("float32", "bfloat16", "int8")
# Adam's (and AdamW's) learning rate when --lr is not given (SGD's would be far too large),
# and AdamW's --weight-decay: torch.optim.AdamW's defaults, as their optimizers hold them.
ADAM_LR = OPTIMIZERS["adam"].default_lr
ADAMW_DECAY = OPTIMIZERS["adamw"].default_decay
# What every rank builds its model with unless --init-seed says otherwise (the 2014 demo's
# RandomState(1234)): replicas start identical.
MODEL_SEED = 1234
MAX_WORKERS = 8


# A setting a run cannot take: the one error type that names its flag (pympgu.errors).
UsageError = FlagError


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a training run is given (the flags of ``python -m pympgu.train``)."""

    # Where to run: a GPU index per worker (of each node), or None per CPU worker; nodes.
    devices: tuple = (None, None)
    nnodes: int = 1
    backend: str = "jax"
    method: str = "auto"
    # Data: a --data-dir (None: the embedded MNIST test set).
    data: str = None
    # The model: --model (None: the MLP of ``hidden``) and its widths.
    model: str = None
    hidden: tuple = (500,)
    # The optimizer and its schedule.
    epochs: int = 5
    batch_size: int = 128
    optimizer: str = "sgd"
    lr: float = 0.05
    schedule: str = "constant"
    warmup: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False
    beta2: float = 0.999
    weight_decay: float = 0.0
    clip_norm: float = 0.0
    ema: float = 0.0
    patience: int = 0
    l1: float = 0.0
    l2: float = 1e-4
    dropout: float = 0.0
    label_smoothing: float = 0.0
    flip: bool = False
    shift: int = 0
    bn_examples: int = STATISTICS_EXAMPLES
    compute_dtype: str = "float32"
    # The exchange.
    sync_every: int = 1
    overlap: bool = False
    exchange_dtype: str = "float32"
    exchange_blocks: int = None
    # Between nodes (--across-nodes): every step, or every outer_every steps averaged,
    # taken by DiLoCo's outer Nesterov step (its rate and momentum: the paper's defaults)
    # or pulled toward EASGD's centre (its alpha: None, the paper's 0.9 / nodes).
    across_nodes: str = "every-step"
    outer_every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    easgd_alpha: float = None
    outer_dtype: str = "float32"  # what an outer optimizer sends between nodes
    outer_streams: int = 1  # the parameters' fragments meeting in turn (Streaming DiLoCo)
    outer_overlap: int = 0  # steps a fragment's meeting runs beside (0: it blocks)
    # How many workers must remain for the run to go on without a lost one (None: all).
    min_workers: int = None
    # How many times in all a lost worker's place is taken by a new one (--restart-workers).
    restart_workers: int = 0
    # Seeds: of the data order, dropout and augmentation; of the starting weights.
    seed: int = 0
    init_seed: int = MODEL_SEED
    # Output.
    out: str = None
    resume: str = None

    def __post_init__(self):
        # Lists (from JSON or a caller) become tuples: the configuration stays hashable and
        # immutable in every worker.
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
        self.check()

    @property
    def nworkers(self):
        """Every worker of every node."""
        return self.nnodes * len(self.devices)

    @property
    def cpu(self):
        """Whether the workers are CPU workers."""
        return self.devices[0] is None

    def replace(self, **changes):
        """A copy with ``changes``, checked."""
        return dataclasses.replace(self, **changes)

    def check(self):
        """Raise UsageError naming the first setting out of range."""
        def need(ok, flag, message):
            if not ok:
                raise UsageError(flag, f"{flag} {message}")

        need(1 <= len(self.devices) <= MAX_WORKERS, "--gpus" if self.devices[:1] != (None,)
             else "--cpu", f"must name 1 to {MAX_WORKERS} workers, got {len(self.devices)}")
        need(all(d is None for d in self.devices) or all(isinstance(d, int) and d >= 0
                                                         for d in self.devices),
             "--gpus", f"takes GPU indexes, or --cpu N alone; got {list(self.devices)}")
        from ..runtime.nodes import MAX_NODES
        need(1 <= self.nnodes <= MAX_NODES, "--nnodes",
             f"must be 1 to {MAX_NODES}, got {self.nnodes}")
        need(self.nnodes == 1 or self.exchange_dtype == "float32", "--exchange-dtype",
             f"{self.exchange_dtype}: across nodes the exchange is float32 (a half-precision "
             "wire's error across nodes is not measured yet)")
        need(self.backend in BACKENDS, "--backend", f"must be one of {BACKENDS}")
        need(self.cpu or self.backend == "jax", "--backend",
             "c runs on CPUs only; GPU workers use --backend jax")
        need(self.exchange_dtype in methods.WIRES, "--exchange-dtype",
             f"must be one of {methods.WIRES}")
        need(self.method in methods.NAMES, "--method", f"must be one of {methods.NAMES}")
        way = methods.REGISTRY.get(self.method)
        need(not way.nccl or not self.cpu, "--method",
             f"{self.method}: NCCL averages GPU workers' replicas; CPU workers take 'auto'")
        need(self.exchange_dtype in way.wires, "--exchange-dtype",
             f"{self.exchange_dtype}: --method {self.method} averages {' or '.join(way.wires)} "
             "(the half-precision wires are pympgu's kernels')")
        need(self.optimizer in OPTIMIZERS, "--optimizer", f"must be one of {list(OPTIMIZERS)}")
        need(self.schedule in SCHEDULES, "--schedule", f"must be one of {list(SCHEDULES)}")
        need(self.compute_dtype in COMPUTE_DTYPES, "--compute-dtype",
             f"must be one of {list(COMPUTE_DTYPES)}")
        need(self.compute_dtype == "float32" or self.backend == "jax", "--compute-dtype",
             f"{self.compute_dtype} needs --backend jax (PyTensor's own backend multiplies in "
             "its variables' dtype)")
        need(all(h >= 1 for h in self.hidden) and self.hidden, "--hidden",
             f"widths must be positive, got {list(self.hidden)}")
        need(self.lr > 0, "--lr", f"must be positive, got {self.lr}")
        need(0 <= self.momentum < 1, "--momentum", f"must be in [0, 1), got {self.momentum}")
        need(0 <= self.beta2 < 1, "--beta2", f"must be in [0, 1), got {self.beta2}")
        need(not self.nesterov or OPTIMIZERS[self.optimizer].nesterov, "--nesterov",
             "is SGD's momentum; Adam's beta1 is --momentum")
        need(not self.nesterov or self.momentum > 0, "--nesterov",
             f"needs a --momentum above 0, got {self.momentum}")
        need(0 <= self.weight_decay < 1, "--weight-decay",
             f"must be in [0, 1), got {self.weight_decay}")
        need(self.weight_decay == 0 or OPTIMIZERS[self.optimizer].decays, "--weight-decay",
             "is AdamW's decoupled decay; give --optimizer adamw with it (--l2 penalises the "
             "weights for sgd and adam)")
        need(self.clip_norm >= 0, "--clip-norm", f"must be 0 (off) or above, got {self.clip_norm}")
        need(0 <= self.ema < 1, "--ema", f"must be in [0, 1) (0: off), got {self.ema}")
        need(self.patience >= 0, "--patience",
             f"must be 0 (off) or more epochs, got {self.patience}")
        need(0 <= self.dropout < 1, "--dropout", f"must be in [0, 1), got {self.dropout}")
        need(0 <= self.label_smoothing < 1, "--label-smoothing",
             f"must be in [0, 1), got {self.label_smoothing}")
        need(self.shift >= 0, "--shift", f"must be 0 or more pixels, got {self.shift}")
        for flag, value in (("--epochs", self.epochs), ("--batch-size", self.batch_size),
                            ("--sync-every", self.sync_every),
                            ("--bn-examples", self.bn_examples)):
            need(value >= 1, flag, f"must be at least 1, got {value}")
        # Longer than the run is allowed: it may be resumed for more epochs (the command
        # line refuses it, pympgu.training.cli).
        need(self.warmup >= 0, "--warmup", f"must be 0 or more epochs, got {self.warmup}")
        self._check_min_workers(need)
        self._check_across_nodes(need)
        need(self.exchange_blocks is None or 1 <= self.exchange_blocks <= 512,
             "--exchange-blocks", f"must be 1 to 512, got {self.exchange_blocks}")

    def _check_min_workers(self, need):
        n = self.nworkers
        need(self.restart_workers >= 0, "--restart-workers",
             f"must be 0 or more, got {self.restart_workers}")
        need(not self.restart_workers or (self.min_workers or n) < n, "--restart-workers",
             "restarts a lost worker of a run that goes on without it: give --min-workers "
             f"below the {n} workers too")
        if self.min_workers is None or self.min_workers == n:
            return
        need(1 <= self.min_workers <= n, "--min-workers",
             f"must be 1 to the {n} workers, got {self.min_workers}")
        # What goes on without a lost worker, said here rather than found out at the first
        # loss: GPU workers lose a node whole, and only where the nodes meet through the
        # host (docs/DECISIONS.md, "A lost GPU worker takes its node with it").
        need(self.cpu or (self.nnodes > 1 and self.across_nodes != "every-step"),
             "--min-workers", "goes on without a lost GPU worker only across nodes that meet "
             "every H steps (--across-nodes average, diloco or easgd), where its node leaves "
             "the run: give every worker, --cpu N, or one of those")
        need(not self.overlap, "--min-workers", "needs replicas identical after each "
             "exchange; --overlap leaves them alike only at the epoch's end: drop one of them")

    def _check_across_nodes(self, need):
        need(self.across_nodes in ACROSS_NODES, "--across-nodes",
             f"must be one of {list(ACROSS_NODES)}")
        need(self.outer_every >= 1, "--outer-every", f"must be at least 1, got {self.outer_every}")
        need(self.outer_lr > 0, "--outer-lr", f"must be positive, got {self.outer_lr}")
        need(0 <= self.outer_momentum < 1, "--outer-momentum",
             f"must be in [0, 1), got {self.outer_momentum}")
        need(self.outer_dtype in OUTER_DTYPES, "--outer-dtype",
             f"must be one of {list(OUTER_DTYPES)}")
        need(self.outer_dtype == "float32" or self.across_nodes in outer.NAMES, "--outer-dtype",
             f"{self.outer_dtype} is what an outer optimizer sends: give --across-nodes "
             f"{' or '.join(outer.NAMES)}")
        need(self.outer_streams == 1 or self.across_nodes in outer.NAMES, "--outer-streams",
             f"is for an outer optimizer's fragments: give --across-nodes "
             f"{' or '.join(outer.NAMES)}")
        need(1 <= self.outer_streams <= self.outer_every, "--outer-streams",
             f"must be 1 to --outer-every ({self.outer_every}), got {self.outer_streams}")
        need(self.outer_overlap == 0 or self.across_nodes in outer.NAMES, "--outer-overlap",
             f"is for an outer optimizer's meetings: give --across-nodes "
             f"{' or '.join(outer.NAMES)}")
        between = self.outer_every // self.outer_streams
        need(0 <= self.outer_overlap < between, "--outer-overlap",
             f"must be 0 to {between - 1} (a fragment's meeting ends before the next one "
             f"begins, every --outer-every / --outer-streams steps), got {self.outer_overlap}")
        need(self.outer_overlap == 0 or (self.sync_every == 1 and not self.overlap),
             "--outer-overlap", "counts the node's exchanges of the whole state: give "
             "--sync-every 1 without --overlap")
        need(self.easgd_alpha is None or self.across_nodes == "easgd", "--easgd-alpha",
             "is EASGD's: give --across-nodes easgd")
        # The centre moves by alpha times the nodes' summed distance: past 1 / nodes it
        # overshoots their mean.
        need(self.easgd_alpha is None or 0 < self.easgd_alpha * self.nnodes <= 1,
             "--easgd-alpha", f"must be above 0 and at most 1 / nodes (1/{self.nnodes}), got "
             f"{self.easgd_alpha}")
        if self.across_nodes == "every-step":
            return
        need(self.nnodes > 1, "--across-nodes", f"{self.across_nodes} is between nodes: give "
             "--nnodes 2 or more")
        # GPU workers: the kernels inside the node, the host between (docs/DECISIONS.md,
        # "Outer optimizers on GPU workers").
        need(self.cpu or not methods.get(self.method).nccl, "--method",
             f"{self.method} spans every node; with --across-nodes {self.across_nodes} the "
             "GPU exchange stays inside the node: give a kernel method (default: auto)")
        need(not self.overlap, "--across-nodes", f"{self.across_nodes} takes plain exchanges "
             "inside the node; drop --overlap")

    def to_json(self):
        """The configuration as config.json holds it."""
        values = dataclasses.asdict(self)
        values["devices"] = ["cpu" if d is None else d for d in self.devices]
        values["hidden"] = list(self.hidden)
        return values

    @classmethod
    def from_json(cls, values):
        """The configuration that config.json (``values``) holds. Keys this version does not
        know are left out, and missing ones take their defaults, so that a run written by
        another version of pympgu still evaluates and resumes."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in values.items() if k in known}
        if "devices" in values:
            values["devices"] = [None if d == "cpu" else d for d in values["devices"]]
        return cls(**values)

    def dumps(self):
        return json.dumps(self.to_json(), indent=1)


def optimizer_defaults(name):
    """What the optimizer ``name`` changes in the defaults (or a preset) when its flags are
    not given: Adam's and AdamW's learning rate, AdamW's decay, and no L2 penalty for
    either, as torch.optim.Adam's and AdamW's defaults (docs/DECISIONS.md, "Adam without
    an L2 penalty")."""
    chosen, default = OPTIMIZERS[name], OPTIMIZERS[RunConfig.optimizer]
    changes = {}
    if chosen.default_lr != default.default_lr:
        changes["lr"] = chosen.default_lr
    if chosen.default_l2 != default.default_l2:
        changes["l2"] = chosen.default_l2
    if chosen.decays:
        changes["weight_decay"] = chosen.default_decay
    return changes


# The 2014 seed's run: MLP 784-500-10, plain SGD, lr 0.13, batch 5000, L2 1e-4, 10 epochs.
PRESETS = {"dual_mlp": dict(hidden=(500,), lr=0.13, momentum=0.0, batch_size=5000, l1=0.0,
                            l2=1e-4, epochs=10)}


def auto_backend(cpu):
    """What --backend auto means: JAX on GPUs, and on CPU workers wherever it is installed,
    where XLA runs the MLP about twice and the convnets 8 to 10 times as fast as PyTensor's
    own backend (docs/DECISIONS.md, "JAX on CPU workers"); else 'c'."""
    return "jax" if not cpu or importlib.util.find_spec("jax") is not None else "c"
