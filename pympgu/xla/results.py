"""A function's results averaged as soon as each is computed: the step cut in two, so that
the last layers' values cross the link while it computes the first layers'."""
import math

import numpy as np

from .. import methods, settings
from . import ops
from .split import Split, trace


def send_in_parts(split, flat, attrs, offsets, part_attrs=None):
    """Evaluate ``split`` (a split.Split with early results) on ``flat`` with its early
    results' start between its phases and its late results' start after them; ``offsets[i]``
    is output i's offset in the buffer, and ``part_attrs(part)``, if given, a part's own
    attributes (its algorithm and grid). Returns the last token, every output, and the parts
    with the kind of done or wait that each takes: the early one's when it has landed, the
    late one's when everything has."""
    from jax import lax
    part_attrs = part_attrs or (lambda part: attrs)

    def start(values):
        return ops.start(values, part_attrs(split.early), ops.FIRST if split.late else ops.WHOLE,
                      ops.part_offsets(offsets, split.early))

    token, outs = split.run(flat, start, lambda t, v: lax.optimization_barrier((t, v)))
    parts = [(split.early, ops.DONE_FIRST if split.late else ops.DONE_WHOLE)]
    if split.late:  # after phase 2 by its operands, and after the first part by the token
        token = ops.start([outs[i] for i in split.late], part_attrs(split.late), ops.LAST,
                       ops.part_offsets(offsets, split.late), after=token)
        parts.append((split.late, ops.DONE_LAST))
    return token, outs, parts


def average_results(fn, which, group, *args, algo="auto", max_blocks=None):
    """``fn(*args)``, a flat list of arrays, with the arrays at positions ``which`` replaced by
    their means over every rank; each mean starts as soon as its array is computed.

    With ``algo="auto"``, float32 arrays and a group made with ``shadow=True`` (an Exchanger
    made with ``shadow=True``), ``fn`` is cut in two (pympgu.xla.split): the arrays computed
    first, such as a network's last layers, cross the link by DMA while ``fn`` computes the
    rest, and the others follow. One pass at the end averages them all, summed in rank
    order, so every rank gets the same bits. Otherwise, for exchanges under
    PYMPGU_SPLIT_MIN_BYTES or groups of more than PYMPGU_SPLIT_MAX_RANKS ranks, or when ``fn`` offers
    nothing to hide the link behind, it is ``average`` after ``fn``. The rules of
    ``average`` apply (module docstring); ``which`` names the arrays in the order the
    group's buffer lays them out.
    """
    import jax
    from jax import lax
    flat = list(args)
    which = list(which)
    split = None
    if (which and getattr(group, "shadow_offset", 0) and group.nranks > 1
            and ops.copies_to_every_peer(group.nranks) and methods.chooses(algo)):
        closed = trace(fn, flat)
        shapes = [closed.jaxpr.outvars[i].aval for i in which]
        nbytes = sum(math.prod(s.shape) * 4 for s in shapes)
        # Small exchanges are not cut: the kernels average them in tens of microseconds,
        # less than the second part and its copies cost the host (docs/DECISIONS.md, "The
        # cut step").
        if all(s.dtype == np.float32 for s in shapes) and nbytes >= settings.get().split_min_bytes:
            split = Split(closed, which)
            if not split.early:
                split = None
    if split is None:
        outs = list(fn(*flat))
        for i, mean in zip(which, ops.average([outs[i] for i in which], group, algo, max_blocks)):
            outs[i] = mean
        return outs
    attrs, _ = ops.attributes([jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes], group,
                           algo, max_blocks, overlapped=True)
    offsets = dict(zip(which, attrs["offsets"]))
    # The first part is averaged while the last crosses the link.
    token, outs, parts = send_in_parts(split, flat, attrs, offsets)
    token, outs = lax.optimization_barrier((token, outs))
    for part, kind in parts:
        means = ops.done(token, [outs[i] for i in part], attrs, in_place=True, part=kind,
                      offsets=ops.part_offsets(offsets, part))
        if kind == ops.DONE_FIRST:
            # Puts the last part's done after this one on XLA's stream, where the two would
            # otherwise go in any order.
            token, means = lax.optimization_barrier((token, means))
        for i, mean in zip(part, means):
            outs[i] = mean
    return outs
