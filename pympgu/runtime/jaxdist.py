"""JAX's multi-process runtime, which CPU workers on several nodes join before their first
JAX computation: its collectives (gloo) carry pympgu.exchange.across's sums between nodes
(docs/DECISIONS.md, "CPU workers across nodes")."""
import os

_state = {}


def join(ctx):
    """Join JAX's multi-process runtime: global rank 0 serves the rendezvous at
    ``ctx.data_address``."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        import jax
    except ImportError:
        raise RuntimeError("CPU workers on several nodes meet through JAX's multi-process "
                           "runtime: pip install jax") from None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(ctx.data_address, num_processes=ctx.nranks,
                               process_id=ctx.rank)
    _state["ready"] = True


def joined():
    """Whether this process has joined (join) and not left."""
    return bool(_state.get("ready"))


def leave():
    """Leave JAX's multi-process runtime, with every other rank (a barrier)."""
    if _state.pop("ready", False):
        import jax
        jax.distributed.shutdown()
