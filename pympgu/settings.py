"""pympgu's environment variables, read once per process into typed, frozen settings.

Every ``PYMPGU_*`` variable that changes what pympgu does at run time is read here and
nowhere else, but for the two that say where a run's nodes meet, which pympgu.runtime.nodes reads
(PYMPGU_COORDINATOR, and PYMPGU_SECRET, which must never join settings that ranks compare
and print). Each field of :class:`Settings` is read from ``PYMPGU_<FIELD>`` (upper case);
an unset or empty variable keeps the default, and a value that does not parse raises
:class:`SettingsError` naming the variable. The defaults are tuned constants, each with its
entry in docs/DECISIONS.md; override them only to tune pympgu on other hardware.

Every rank of a group must run with the same settings: they decide which algorithm 'auto'
picks and how a step's exchange is laid into its XLA program, and ranks that chose
differently would wait at barriers for partners that never come. The ranks compare
``fingerprint()`` before any exchange.
"""
import dataclasses
import functools
import os

PREFIX = "PYMPGU_"


class SettingsError(ValueError):
    """A PYMPGU_* variable that does not parse; the message names it."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What pympgu reads from the environment (module docstring)."""

    # 'auto''s algorithm by buffer size (pympgu.cuda.PeerGroup.algorithm; DECISIONS.md,
    # "Algorithm thresholds"). ll_max_bytes is capped at the mailboxes' 256 KiB.
    ll_max_bytes: int = 256 * 1024
    oneshot_max_bytes: int = 128 * 1024
    push_min_bytes: int = 16 << 20
    ce_min_bytes: int = 512 << 20
    ce_chunk_bytes: int = 16 << 20
    # The training step cut in two for exchanges of at least split_min_bytes on at most
    # split_max_ranks ranks (DECISIONS.md, "The cut step"); a kernel beside XLA's work
    # capped at beside_blocks blocks (DECISIONS.md, "Kernels beside the step").
    split_min_bytes: int = 16 << 20
    split_max_ranks: int = 2
    beside_blocks: int = 64
    # Average by the copy method with host barriers even where GPUs have peer access: for
    # machines whose peer-to-peer path is reported but broken.
    no_p2p: bool = False
    # Each CPU worker of a node on its own share of the cores (pympgu.runtime.cores;
    # DECISIONS.md, "CPU workers on cores of their own"); 0 leaves them to the kernel.
    pin_cpu_workers: bool = True

    def fingerprint(self):
        """The settings every rank of a group must share, as text."""
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    @staticmethod
    def variable(name):
        """The environment variable of field ``name``."""
        return PREFIX + name.upper()


# Field: (least value, greatest value or None); booleans take '0' or '1'.
_BOUNDS = {"ll_max_bytes": (0, None), "oneshot_max_bytes": (0, None),
           "push_min_bytes": (0, None), "ce_min_bytes": (0, None),
           "ce_chunk_bytes": (256, None), "split_min_bytes": (0, None),
           "split_max_ranks": (1, 8), "beside_blocks": (1, 512)}


def load(environ=None):
    """Settings from ``environ`` (default: this process's environment), checked."""
    environ = os.environ if environ is None else environ
    values = {}
    for field in dataclasses.fields(Settings):
        name = Settings.variable(field.name)
        text = environ.get(name, "").strip()
        if not text:
            continue
        if field.type in (bool, "bool"):
            if text not in ("0", "1"):
                raise SettingsError(f"{name} must be 0 or 1, got {text!r}")
            values[field.name] = text == "1"
            continue
        least, most = _BOUNDS[field.name]
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least or (most is not None and value > most):
            span = f"{least} to {most}" if most is not None else f"{least} or more"
            raise SettingsError(f"{name} must be a whole number, {span}; got {text!r}")
        values[field.name] = value
    return Settings(**values)


@functools.cache
def get():
    """This process's settings, read from its environment at the first call."""
    return load()


def reload():
    """Read the environment again at the next get(): for tests that change it."""
    get.cache_clear()
