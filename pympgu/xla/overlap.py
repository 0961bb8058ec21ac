"""Exchanges beside XLA's work: the average taken while a function computes, and the
one-step-delayed correction of an overlapped training step, fused into its update."""
import math

import numpy as np

from .. import methods
from . import ops
from .split import Tail, trace


def average_during(arrays, group, fn, *args, algo="auto", max_blocks=None):
    """``(averages, fn(*args))``: the mean over every rank of each array in ``arrays``, taken
    while ``fn`` computes. ``args`` and ``fn``'s result are JAX arrays, or pytrees of them.

    ``fn`` starts once the arrays are packed, and the averages are made once it has
    finished; in between, the peers' data crosses the link on the group's high-priority side
    stream beside ``fn``'s kernels. With ``algo="auto"`` float32 arrays go by the copy
    engines ('gather'), which leave every SM to ``fn``, on up to PYMPGU_SPLIT_MAX_RANKS ranks
    (copies_to_every_peer), and by the group's kernel above; the kernels may be named.
    The same rules as ``average`` apply (module docstring). Put in ``fn`` the work that does
    not need the averages: the overlap is at most its length.
    """
    return _overlapped(list(arrays), group, fn, args, algo, max_blocks, correct=False)


def correct_during(arrays, group, fn, *args, algo="auto", max_blocks=None, shadow=None,
                   ready=()):
    """The one-step-delayed correction of an overlapped exchange, in one call.

    ``fn(*args)`` returns ``(new, extra)``, where ``new`` is a list whose first
    ``len(arrays)`` entries are the successors of ``arrays`` (same shapes), computed while
    ``arrays`` are averaged as in ``average_during``; any further entries are other values
    of the same update (the parameters, when their momentum is averaged), neither
    corrected nor returned. Returns ``([new_i + (mean_i - arrays_i)], extra)``: the step's
    own change, applied to the average. With the gather algorithm the average and the
    correction are one pass over the bytes.

    ``shadow`` (``shadow_array(group)``, passed into the jitted function as an argument;
    the gather algorithm and a shared shadow) takes that pass away: the mean is summed,
    in rank order, inside XLA's own elementwise update of each array (``fn``'s
    elementwise tail, pympgu.xla.split.Tail), which then reads the peers' values straight
    from the shadow where they landed. XLA's stream waits for them just before that
    update, once the gradients it reads exist.

    ``fn``'s work waits for the exchange's start through the arguments it reads, except
    ``arrays`` and ``ready``: list there the arguments that need not wait (a model's state
    that is not averaged at this step), since what comes out of that wait is not fused as
    freely (``_hold``).
    """
    return _overlapped(list(arrays), group, fn, args, algo, max_blocks, correct=True,
                       shadow=shadow, ready=ready)


def shadow_array(group, dtype="float32"):
    """``correct_during``'s ``shadow`` for ``group``: a JAX array of ``dtype`` over its
    shared shadow, without a copy (average_gradients' takes its wire's dtype). Pass it
    into the jitted function as an argument: closed over, JAX would copy it into the
    program as a constant. None when the group has no shared shadow, or
    when its number of ranks is not a power of two: XLA's division then rounds otherwise
    than pympgu's kernels (by one unit in the last place, seen on 3 H200 ranks), or when
    'auto' does not take the gather algorithm on that many ranks (copies_to_every_peer)."""
    import jax
    if not ops.reads_shadow(group.nranks):
        return None
    view = group.shadow_view(dtype)
    return None if view is None else jax.dlpack.from_dlpack(view)


def _overlapped(arrays, group, fn, args, algo, max_blocks, correct, shadow=None, ready=()):
    from jax import lax
    if not arrays:
        result = fn(*args)
        return ([], result[1]) if correct else ([], result)
    attrs, chosen = ops.attributes(arrays, group, algo, max_blocks, overlapped=True)
    if shadow is not None and not (methods.gathers(chosen) and getattr(group, "shadow_offset", 0)
                                   and ops.fusable(group.nranks)):
        raise ValueError("correct_during: shadow= needs the gather algorithm (float32, algo "
                         "'auto' or 'gather'), a group made with shadow=True, and a power "
                         "of two ranks")
    token = ops.start(arrays, attrs, ops.WHOLE)
    # XLA orders independent work as it likes; these barriers make fn's inputs wait for the
    # start, and the done wait for fn's results, so that fn runs while the link works.
    token, args = _hold(token, args, [*arrays, *ready])
    if shadow is not None:
        fused = _corrected_in_update(arrays, group, fn, args, attrs, token, shadow)
        if fused is not None:
            return fused
    result = fn(*args)
    token, result = lax.optimization_barrier((token, result))
    if not correct:
        return ops.done(token, arrays, attrs), result
    new, extra = result
    fresh = _fresh(new, arrays)
    if methods.gathers(chosen):  # the correction fused into the average's pass
        return ops.done(token, arrays, attrs, fresh), extra
    means = ops.done(token, arrays, attrs)
    return [f + (m - a) for f, m, a in zip(fresh, means, arrays)], extra


def _hold(token, args, arrays):
    """``(token, args)``, with the arguments that are not among ``arrays`` (a training
    step's minibatch, say) held behind the start's token: fn's work that needs them waits
    for the start. ``arrays`` (the averaged ones, and any others that need not wait) are not
    held: with the weights and biases coming out of the barrier too, XLA stops fusing the
    bias adds into cuBLAS's matrix products (docs/DECISIONS.md, "Overlap"). When
    no argument is left to hold, all are held."""
    import jax
    from jax import lax
    leaves, tree = jax.tree_util.tree_flatten(args)
    own = {id(a) for a in arrays}
    held = [i for i, leaf in enumerate(leaves) if id(leaf) not in own] or range(len(leaves))
    token, kept = lax.optimization_barrier((token, [leaves[i] for i in held]))
    for i, leaf in zip(held, kept):
        leaves[i] = leaf
    return token, jax.tree_util.tree_unflatten(tree, leaves)


def _corrected_in_update(arrays, group, fn, args, attrs, token, shadow):
    """correct_during's result with the correction inside fn's own update (``shadow``), or
    None when fn has no work before its update for the wait to follow (then pympgu's pass
    corrects)."""
    import jax
    from jax import lax
    leaves, tree = jax.tree_util.tree_flatten(args)

    out_tree, updated = [], []

    def flat(*xs):
        result = fn(*jax.tree_util.tree_unflatten(tree, xs))
        outs, structure = jax.tree_util.tree_flatten(result)
        out_tree[:], updated[:] = [structure], [len(result[0])]
        return outs

    # Inlined: fn may return a jitted program's results in an order of its own (JaxStep).
    # The tail is that of every new value fn returns, not of the averaged arrays' alone:
    # the parameters' update reads the momentum's new value, which would otherwise leave
    # the momentum's tail empty when the momentum alone is averaged.
    cut = Tail(trace(flat, leaves, inline=True), range(updated[0]))

    if not cut.crossing:
        return None

    def hold(gradients):
        # The wait takes what the update reads from before it (the gradients), so that XLA's
        # stream waits there; it passes the smallest through, so that XLA keeps it (XLA
        # drops an operation whose results nothing uses, even through a barrier).
        k = min(range(len(gradients)), key=lambda i: math.prod(gradients[i].shape))
        gradients = list(gradients)
        gradients[k] = ops.wait(token, gradients, attrs, k)
        return lax.optimization_barrier((gradients, shadow))

    outs, landed = cut.run(leaves, hold)
    new, extra = jax.tree_util.tree_unflatten(out_tree[0], outs)
    slot = ops.slot_elems(group, int(attrs["total"]))
    return [f + (rank_mean(a, landed, at, slot, group) - a)
            for f, a, at in zip(_fresh(new, arrays), arrays, attrs["offsets"])], extra


def rank_mean(own, landed, at, slot, group):
    """The mean of ``own`` over every rank, in XLA's arithmetic: the peers' values are read
    from the shadow where they landed (``landed``, slots of ``slot`` elements, the array at
    element ``at`` of each). Summed as pmg_mean_list sums (csrc/local.cu), in rank order,
    then one division, by a power of two, which XLA rounds as the kernel does
    (shadow_array). Values of a half-precision wire are summed in float32, as the kernels
    sum them."""
    from jax import lax
    rank, nranks = group.rank, group.nranks
    size = math.prod(own.shape)
    total = None
    for r in range(nranks):
        if r == rank:
            term = own
        else:
            begin = (r if r < rank else r - 1) * slot + int(at)
            term = lax.slice(landed, (begin,), (begin + size,)).reshape(own.shape)
        term = term.astype(np.float32)
        total = term if total is None else total + term
    return total / np.float32(nranks)


def _fresh(new, arrays):
    """The successors of ``arrays`` at the head of ``new``, checked."""
    fresh = list(new[:len(arrays)])
    if [(f.shape, f.dtype) for f in fresh] != [(a.shape, a.dtype) for a in arrays]:
        raise ValueError("correct_during: fn's new values must begin with one array per "
                         f"averaged array, of its shape and dtype; got {len(fresh)} for "
                         f"{len(arrays)}")
    return fresh
