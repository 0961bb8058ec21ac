"""The gradients' road: every rank's update computed from the ranks' mean gradients, inside
the step, with no pass over the parameters (DDP's average, in XLA)."""
import functools
import math

import numpy as np

from .. import methods, settings
from . import ops
from .overlap import rank_mean
from .results import average_results, send_in_parts
from .alike import DETERMINISTIC_FLAG, deterministic_reductions
from .split import REDUCTIONS, Split, Tail, trace


def average_gradients(fn, updated, which, group, *args, shadow=None, local=(), algo="auto",
                      max_blocks=None, plan=None, exact=True, wire=None, alike=False):
    """``fn(*args)``, a flat list of arrays, with its results at ``updated`` (a training
    step's new state) computed from the mean over every rank of what their update reads:
    DDP's average of the gradients, inside the step, with no pass over the parameters.

    ``fn``'s results at ``updated`` must come out of an elementwise update
    (pympgu.xla.split.Tail) that is affine in what it reads from the work before it (its
    gradients: SGD, with momentum, weight decay or L1 terms, is), and every rank must start
    from the same values of every argument but those at positions ``local`` (the
    minibatch), which the update must not read. Then every rank computes the same update
    of the same mean, the same bits, and that update is the mean of the ranks' own updates,
    up to rounding: what ``average_results(fn, updated)`` would give.

    The gradients computed first cross while ``fn`` computes the rest (split.Split), and the
    first part's update runs while the rest cross. Two ways (gradients_by_copies says which):

    - on up to PYMPGU_SPLIT_MAX_RANKS ranks (a power of two) with ``shadow`` (shadow_array(group),
      passed into the jitted function as an argument) and ``algo="auto"``, every rank's
      gradients cross whole by DMA, straight into the peers' shared shadow, and XLA's own
      update reads them there, summed in rank order;
    - otherwise the group's kernel averages each part on the side stream (the first part's
      capped at PYMPGU_BESIDE_BLOCKS blocks, beside XLA's work, unless ``max_blocks`` is given),
      sending 2 (R - 1) / R of the bytes, and the update reads the means it unpacks.

    Where neither applies (gradient_plan says why), it returns ``average_results(fn, which,
    group, *args)``: the results at ``which`` averaged after they are computed. ``plan``,
    gradient_plan's result for these arguments, saves tracing ``fn`` again.

    ``exact=False`` takes any elementwise update, at any size: an update not affine in its
    gradients (Adam's) then is not the mean of the ranks' updates but the update of their
    mean gradient, what DDP computes, the same on every rank. Sums of what crosses that
    the update reads (the norm of a clipped update, split.Tail's ``statistics``) are then
    computed from the means too; on GPUs only where every rank compiles them to the same
    kernels, so that they sum in the same order: ``alike=True`` says that the jitted step
    takes ``compiler_options=alike_options()`` (else DETERMINISTIC_FLAG in XLA_FLAGS).

    ``wire='bfloat16'`` (or 'float16') sends the gradients rounded to it, half the bytes,
    as DDP's bf16_compress_hook does, at any size: every rank sums the ranks' rounded
    values in float32, in rank order (its own rounded too), so the update still reads the
    same mean on every rank (by the kernel: their mean, rounded to the wire). The shadow is
    then ``shadow_array(group, wire)``. Where the gradients do not cross, nothing is
    rounded: ``average_results`` averages the results in float32.
    """
    import jax
    flat = list(args)
    if plan is None:
        plan = gradient_plan(fn, updated, group, flat, local, shadow, algo, exact, wire, alike)
    tail = plan[0]
    if tail is None:
        return average_results(fn, which, group, *flat, algo=algo, max_blocks=max_blocks)
    n = len(tail.crossing)
    low = _wire(wire)
    crossing = [jax.ShapeDtypeStruct(v.aval.shape, low or v.aval.dtype) for v in tail.crossing]

    def before(*a):  # the work before the update, its gradients rounded to the wire's dtype
        outs = list(tail.evaluate_before(a))
        return [o.astype(low) for o in outs[:n]] + outs[n:] if low else outs

    # Each gradient crosses whole, not in row blocks: the update would then read the
    # blocks' concatenation, which XLA splits from the weights' pass and puts after the
    # last wait (docs/DECISIONS.md, "The gradients' road").
    split = Split(trace(before, flat), range(n))
    if gradients_by_copies(group, shadow, algo):
        attrs, offsets, part_attrs, means = _by_copies(crossing, group, shadow, algo,
                                                       max_blocks)
    else:
        attrs, offsets, part_attrs, means = _by_kernel(crossing, group, algo, max_blocks,
                                                       split, low)
    token, outs, parts = _send(split, before, flat, n, attrs, offsets, part_attrs)
    # fn's other results (a step's cost), computed before the first wait: XLA would
    # otherwise put them last, where the stream has nothing else to do, when it could run
    # them while it waits for the first part to land (the wide MLP's L2 term reads every
    # weight: 0.02 ms).
    others = [o for o in outs[n:] if hasattr(o, "shape")]
    waiting = functools.partial(_waiting, token, attrs, others, means)
    made = tail.evaluate_tail(flat, outs[:n], [waiting(part, kind) for part, kind in parts])
    rest = dict(zip(tail.rest(), outs[n:]))
    return [rest[k] if k in rest else made[k] for k in range(len(made))]


def _send(split, before, flat, n, attrs, offsets, part_attrs):
    """``(token, outs, parts)``: the gradients sent in the split's parts, or, with nothing
    worth cutting, whole once the work before the update is done."""
    if split.early:
        return send_in_parts(split, flat, attrs, offsets, part_attrs)
    outs = before(*flat)
    token = ops.start(outs[:n], attrs, ops.WHOLE, attrs["offsets"])
    return token, outs, [(list(range(n)), ops.DONE_WHOLE)]


def _by_copies(crossing, group, shadow, algo, max_blocks):
    """``(attrs, offsets, None, means)`` for average_gradients when every rank's gradients
    cross whole by DMA into the peers' shadow: ``means`` reads them there after the wait."""
    from jax import lax
    if shadow.dtype != crossing[0].dtype:
        raise ValueError(f"average_gradients: the shadow is {shadow.dtype}, the wire "
                         f"{crossing[0].dtype}: pass shadow_array(group, wire)")
    attrs, _ = ops.attributes(crossing, group, algo, max_blocks, overlapped=True, pushed=True)
    offsets = attrs["offsets"]
    slot = ops.slot_elems(group, int(attrs["total"]), crossing[0].dtype.itemsize)

    def means(token, values, part, kind):  # the shadow's reads after the wait
        values, landed = lax.optimization_barrier((values, shadow))
        return [rank_mean(v, landed, offsets[i], slot, group) for v, i in zip(values, part)]
    return attrs, offsets, None, means


def _by_kernel(crossing, group, algo, max_blocks, split, low):
    """``(attrs, offsets, part_attrs, means)`` for average_gradients when the group's kernel
    averages each part: each part's arrays lie together in the buffer, the first part's
    first, so that its kernel averages their stretch alone."""
    n = len(crossing)
    order = [*split.early, *split.late] if split.early else list(range(n))
    attrs, _ = ops.attributes([crossing[i] for i in order], group, algo, max_blocks)
    offsets = np.empty(n, np.int64)
    offsets[order] = attrs["offsets"]
    part_attrs = functools.partial(_kernel_part, attrs, offsets, crossing, group, algo,
                                   max_blocks, split)

    def means(token, values, part, kind):
        # Unpacked, rather than read in place from the buffer (docs/DECISIONS.md, "The
        # gradients' road").
        got = ops.done(token, values, part_attrs(part), part=kind,
                       offsets=ops.part_offsets(offsets, part))
        return [m.astype(np.float32) for m in got] if low else got
    return attrs, offsets, part_attrs, means


def _waiting(token, attrs, others, means, part, kind):
    """``(part, take)`` for split.Tail.evaluate_tail: ``take`` has XLA's stream wait for the
    part to land once its gradients exist (and fn's other results, for the first), and,
    for the last part, once the first part's update is queued, so that it runs while the
    last part crosses. The smallest array passes through the wait, so that XLA keeps it."""
    def take(values, earlier):
        values = list(values)
        k = min(range(len(values)), key=lambda i: math.prod(values[i].shape))
        after = values + ([min(earlier, key=lambda e: math.prod(e.shape))] if earlier
                          else others)
        values[k] = ops.wait(token, after, attrs, k, part=kind)
        return means(token, values, part, kind)
    return part, take


def _wire(wire):
    """The dtype gradients cross in for average_gradients' ``wire``, or None: their own."""
    if wire in (None, "float32"):
        return None
    if wire not in ("bfloat16", "float16"):
        raise ValueError(f"wire must be 'float32', 'bfloat16' or 'float16', got {wire!r}")
    import jax.numpy as jnp
    return jnp.dtype(wire)


def gradients_by_copies(group, shadow, algo):
    """Whether average_gradients sends every rank's whole gradients by DMA into the peers'
    shared shadow for XLA's update to sum, rather than averaging them with the group's
    kernel: on up to PYMPGU_SPLIT_MAX_RANKS ranks, a power of two (_reads_shadow), given the
    shadow and 'auto'."""
    return bool(ops.reads_shadow(group.nranks) and shadow is not None and methods.chooses(algo)
                and getattr(group, "shadow_offset", 0))


def _kernel_part(attrs, offsets, crossing, group, algo, max_blocks, split, part):
    """A part's attributes when the kernel averages the gradients (average_gradients): the
    algorithm for the bytes of its stretch of the buffer (``offsets``, in elements), and,
    for a first part that runs beside XLA's work on the rest, a grid capped at
    PYMPGU_BESIDE_BLOCKS unless ``max_blocks`` is given."""
    from .._cuda import ALGORITHM_CODES
    last = max(part, key=lambda i: offsets[i])
    elements = int(offsets[last]) + math.prod(crossing[last].shape) - min(
        int(offsets[i]) for i in part)
    nbytes = elements * np.dtype(crossing[last].dtype).itemsize
    blocks = int(attrs["max_blocks"])
    if max_blocks is None and split.late and list(part) == list(split.early):
        blocks = min(blocks, settings.get().beside_blocks)
    return dict(attrs, algo=np.int32(ALGORITHM_CODES[group.algorithm(nbytes, algo)]),
                max_blocks=np.int32(blocks))


def gradient_plan(fn, updated, group, args, local=(), shadow=None, algo="auto", exact=True,
                  wire=None, alike=False):
    """``(tail, None)`` when ``average_gradients`` takes ``fn``'s gradients on these flat
    ``args`` (pympgu.xla.split.Tail, the update it feeds), else ``(None, why not)``;
    ``exact``, ``wire`` and ``alike`` as average_gradients takes them. A half-precision
    wire takes them at any size: it is the only road on which it crosses inside XLA."""
    if methods.gathers(algo):
        return None, "the gather algorithm averages parameters only"
    # Exact, the tail need only be affine in what crosses, and any work on gradients alone
    # may go before it; else what crosses must be the gradients themselves, and a norm of
    # them (a clipped update's) is the norm of their mean.
    tail = Tail(trace(fn, list(args), inline=True), list(updated),
                         finish=exact, statistics=not exact)
    if not tail.crossing:
        return None, "the results have no elementwise update"
    # A new value the update does not compute must be the same on every rank: an input
    # passed through, or a constant.
    computed = tail.computed_before(updated)
    if computed:
        return None, f"results {computed} are not computed by an elementwise update"
    if any(v.aval.dtype != np.float32 for v in tail.crossing):
        return None, "the update reads values other than float32 from before it"
    if tail.reads(local):
        return None, "the update reads a rank's own inputs (local=)"
    if not exact:
        if tail.finishing:
            return None, ("the update reads parts of its gradients, not the gradients "
                          f"({tail.finishing[0].primitive.name} of two)")
        if not deterministic_reductions(alike) and any(
                e.primitive.name in REDUCTIONS for e in tail.tail):
            return None, ("the update reduces what crosses (a norm), which XLA's autotuning "
                          "may compile to other kernels, summing in other orders, on each "
                          "rank: jit the step with compiler_options=pympgu.xla."
                          "alike_options() and pass alike=True (pympgu.train does), or set "
                          f"XLA_FLAGS={DETERMINISTIC_FLAG}")
        # The mean gradient's update differs from the mean of the updates: take it at
        # every size, so that what a run computes does not depend on its model's size.
        return tail, None
    bad = tail.nonlinear()
    if bad is not None:
        return None, f"the update is not affine in its gradients ({bad.primitive.name})"
    nbytes = sum(math.prod(v.aval.shape) * 4 for v in tail.crossing)
    if nbytes < settings.get().split_min_bytes and _wire(wire) is None:
        return None, (f"{nbytes} bytes of gradients, under PYMPGU_SPLIT_MIN_BYTES="
                      f"{settings.get().split_min_bytes}")
    return tail, None
