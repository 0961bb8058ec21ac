"""pympgu's average as an XLA operation: average JAX arrays with the other ranks inside jit.

    from pympgu import xla
    step = jax.jit(lambda params, batch: xla.average(sgd(params, batch), group))

``average(arrays, group)`` queues, on XLA's own stream and in the middle of the jitted
function, what an Exchanger does around its kernel: pack the arrays into ``group``'s shared
buffer, all-reduce-average it with every rank (the same kernels, bit-identical replicas), and
unpack. No DLPack export or import, no host wait and no Python run at each call: the host
cost of an exchange becomes that of the jitted call it is part of.

``group`` is a connected ``pympgu.cuda.PeerGroup`` on the GPU the arrays live on, or a
``pympgu.exchange.Exchanger`` (whose method, grid cap and wire then apply, and whose arrays
are its layout's first entries, in its order: ``StepExchange``). Every
rank must call it with arrays of the same shapes and dtype in the same order, and the same
``algo`` and ``max_blocks``, and use its results alike: like XLA's own collectives it is not
a side effect, so XLA removes an average whose results are unused, and merges two averages
of the same arrays. Every rank compiles the same program, so it does so on every rank. The
group must stay open while any function traced with it may still run; after ``close()`` such
a function raises instead of touching freed memory.

``average_during(arrays, group, fn, *args)`` returns the averages and ``fn(*args)``, the
peers' data crossing the link on a side stream of the group's while XLA computes ``fn``: the
link and the SMs work at once. Only a pack (before ``fn``, unless the group has a shared
shadow) and the last pass (after it) stay on XLA's stream. ``correct_during`` is the same
with the one-step-delayed correction of an overlapped training step fused into that last
pass, or, given the shared shadow as a JAX array (``shadow_array``), into ``fn``'s own
update, with no pass at all. ``average_results(fn, which, group, *args)`` averages some of
``fn``'s own results, each sent as soon as it is computed, while ``fn`` computes the rest:
an exact exchange that hides behind the end of a training step, as DDP's gradient buckets
do. ``average_gradients(fn, updated, which, group, *args)`` goes one further for a step
whose ranks start from the same state: the gradients cross instead, and ``fn``'s own
elementwise update reads their mean from the shared shadow, so no pass averages anything
(above PYMPGU_SPLIT_MAX_RANKS ranks the kernel averages them, and the update reads the means).
A group carries one of these exchanges at a time: two start/done pairs on the same group
must not interleave in one function, since both land in the same shadow.

Needs pympgu built with jaxlib's XLA FFI headers (``pip install .`` and ``./build.sh`` get
them; ``python -m pympgu`` says whether this build has them) and JAX with CUDA.

Modules: ops (the FFI operations), overlap, results and gradients (the exchanges beside
XLA's work), split (a traced program cut where results are ready, or before its update),
alike (steps compiled to the same kernels on every rank), step (PyTensor's JAX program
called directly, the exchange fused in) and exchanger (an Exchanger's exchanges).
"""
import functools

from ..exchange import Exchanger
from . import ops
from .alike import DETERMINISTIC_FLAG, alike_options, deterministic_reductions
from .exchanger import StepExchange
from .gradients import gradient_plan, gradients_by_copies
from .ops import available, copies_to_every_peer
from .overlap import shadow_array
from . import gradients as _gradients, overlap as _overlap, results as _results


@functools.wraps(ops.average, assigned=("__doc__",))
def average(arrays, group, algo="auto", max_blocks=None) -> list:
    if isinstance(group, Exchanger):
        return StepExchange(group).average(arrays)
    return ops.average(arrays, group, algo=algo, max_blocks=max_blocks)


@functools.wraps(_overlap.average_during, assigned=("__doc__",))
def average_during(arrays, group, fn, *args, algo="auto", max_blocks=None) -> tuple:
    if isinstance(group, Exchanger):
        return StepExchange(group).average_during(arrays, fn, *args)
    return _overlap.average_during(arrays, group, fn, *args, algo=algo, max_blocks=max_blocks)


@functools.wraps(_overlap.correct_during, assigned=("__doc__",))
def correct_during(arrays, group, fn, *args, algo="auto", max_blocks=None, shadow=None,
                   ready=()) -> tuple:
    if isinstance(group, Exchanger):
        return StepExchange(group).correct_during(arrays, fn, *args, shadow=shadow, ready=ready)
    return _overlap.correct_during(arrays, group, fn, *args, algo=algo, max_blocks=max_blocks,
                                   shadow=shadow, ready=ready)


@functools.wraps(_results.average_results, assigned=("__doc__",))
def average_results(fn, which, group, *args, algo="auto", max_blocks=None) -> list:
    if isinstance(group, Exchanger):
        return StepExchange(group).average_results(fn, which, *args)
    return _results.average_results(fn, which, group, *args, algo=algo, max_blocks=max_blocks)


@functools.wraps(_gradients.average_gradients, assigned=("__doc__",))
def average_gradients(fn, updated, which, group, *args, shadow=None, local=(), algo="auto",
                      max_blocks=None, plan=None, exact=True, wire=None, alike=False) -> list:
    if isinstance(group, Exchanger):
        return StepExchange(group).average_gradients(fn, updated, which, *args, shadow=shadow,
                                                     local=local, exact=exact, alike=alike)
    return _gradients.average_gradients(fn, updated, which, group, *args, shadow=shadow,
                                        local=local, algo=algo, max_blocks=max_blocks,
                                        plan=plan, exact=exact, wire=wire, alike=alike)


__all__ = ["DETERMINISTIC_FLAG", "StepExchange", "alike_options", "available", "average",
           "average_during", "average_gradients", "average_results", "copies_to_every_peer",
           "correct_during", "deterministic_reductions", "gradient_plan",
           "gradients_by_copies", "shadow_array"]
