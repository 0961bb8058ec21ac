"""Worker functions for the GPU tests of the exchange inside XLA (pympgu.xla.StepExchange):
spawned children import them from here."""
import hashlib
import os

import numpy as np

from reference import from_f32, model_average, to_f32
from runtime_targets import LAYOUT, check_bits, rank_params


def xla_rounds(ctx, rounds, method="auto", big=1 << 23, shadow=False, stream_barriers=True,
               timeline=False):
    """The exchange inside a jitted JAX function (pympgu.xla.StepExchange.average): each round's new
    values are averaged in the same XLA call that computes them, checked bit for bit. Rounds
    1, 3, ... take the Python path (start/finish) instead, so the two paths must agree on the
    buffer and on the barriers; round 2 averages only the first two arrays (a prefix of the
    layout), as the training loop's parameters-only exchange does; round 4 is overlapped
    (StepExchange.average_during) with work of its own, checked too, and round 6 applies
    the overlapped step's delayed correction (StepExchange.correct_during), after which the
    ranks' values differ; with a shadow, inside XLA's own arithmetic (StepExchange.shadow;
    which of the two is returned as "corrected"). With method 'auto' both go by the gather
    algorithm, up to PYMPGU_SPLIT_MAX_RANKS ranks. Round 8
    averages a function's own results as they are computed (StepExchange.average_results):
    with a shadow, all but b2 cross the link while a matrix product that b2 depends on is
    computed. Once the Exchanger is closed, the traced function must raise rather than run
    on freed memory. ``stream_barriers``: the Exchanger's; ``timeline``: the group records
    the marks of its exchanges through the start/done pair (PeerGroup.record_timeline)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from pympgu.exchange import Exchanger
    from pympgu.xla import StepExchange
    dev = jax.devices("gpu")[ctx.device]
    layout = LAYOUT + [("big", [big], "float32")]
    xs = [jax.device_put(a, dev) for a in rank_params(0, 0, layout)]
    # The model of every rank's values: they differ after a prefix-only round.
    models = [[np.asarray(a) for a in xs] for _ in range(ctx.nranks)]
    shift = _shift
    ex = Exchanger(ctx, layout, method=method, shadow=shadow, stream_barriers=stream_barriers)
    inside = StepExchange(ex)
    if timeline:
        ex.backend.group.record_timeline()

    try:
        fused, prefix, overlapped, corrected, resulted, step, split = _xla_programs(
            inside, ex, layout)
        for k in range(rounds):
            c = shift(ctx.rank, k)
            if k == 2:
                path, xs, averaged = "XLA prefix", prefix(xs, c), 2
            elif k == 4:
                before = [np.asarray(x) for x in xs]
                xs, beside = overlapped(xs, c)
                path, averaged = "XLA overlapped", len(layout)
                for t, (got, x) in enumerate(zip(beside, before)):
                    if not np.array_equal(np.asarray(got), x * np.float32(3)):
                        raise AssertionError(f"rank {ctx.rank}: the work beside the overlapped "
                                             f"average got tensor {layout[t][0]} wrong")
            elif k == 6:
                shadow = inside.shadow()
                path = "XLA corrected" + (" in the update" if shadow is not None else "")
                corrected_path = path
                xs, averaged = corrected(xs, c, shadow), 0
                models = _corrected_models(models, k, layout, shift)
            elif k == 8:
                path, xs, averaged = "XLA results", resulted(xs, c), len(layout)
            elif k % 2 == 0:
                path, xs, averaged = "XLA", fused(xs, c), len(layout)
            else:
                ex.start(step(xs, c))
                xs = split(jax.dlpack.from_dlpack(ex.finish(flat=True, wait=False)))
                path, averaged = "Python", len(layout)
            if k != 6:
                models = [[m + shift(r, k) for m in ms] for r, ms in enumerate(models)]
            for t in range(averaged):
                mean = model_average([ms[t].ravel() for ms in models], "float32")
                for ms in models:
                    ms[t] = mean.reshape(ms[t].shape)
            check_bits(xs, models[ctx.rank], layout,
                       f"rank {ctx.rank} round {k} ({path} path)")
        # The last round, odd (the Python path), made the replicas identical again.
        digest = hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in xs[:2])).hexdigest()
        # The marks of the last exchange through the start/done pair (round 8), if kept.
        timeline = ex.backend.group.xla_timeline()
    finally:
        ex.close()
    return {"digest": digest, "closed_raises": _raises_closed(fused, xs, shift(ctx.rank, rounds)),
            "timeline": timeline, "corrected": corrected_path}


def _shift(rank, k):
    """What xla_rounds adds to rank ``rank``'s values in round ``k``."""
    return np.float32(0.25 * rank + 0.125 * k)


def _raises_closed(fused, xs, c):
    """Whether a traced exchange of a closed Exchanger raises, naming it closed, rather
    than running on freed memory."""
    import jax
    try:
        jax.block_until_ready(fused(xs, c))
    except Exception as e:  # XLA's runtime error carries the handler's message
        return "is closed" in str(e)
    return False


def _xla_programs(inside, ex, layout):
    """xla_rounds' jitted programs: the average, of a prefix, overlapped, corrected, of a
    function's results, and the Python path's step and split."""
    import jax

    def results(*args):
        *xs, c = args
        ys = [x + c for x in xs]
        # Work that phase 2 computes, and b2 waits for (adding 0 leaves it exact).
        product = jax.numpy.sum((xs[0] @ xs[2]) @ xs[2].T)
        ys[3] = ys[3] + np.float32(0) * product
        return ys + [product]

    fused = jax.jit(lambda xs, c: inside.average([x + c for x in xs]))
    prefix = jax.jit(lambda xs, c: inside.average([x + c for x in xs[:2]]) +
                     [x + c for x in xs[2:]])
    # The work beside the average reads the same inputs and writes arrays of its own;
    # multiplying by 3 rounds alike in JAX and numpy.
    overlapped = jax.jit(lambda xs, c: inside.average_during(
        [x + c for x in xs], lambda ys: [y * np.float32(3) for y in ys], xs))

    # With a shared shadow, XLA applies the correction inside fn's own arithmetic
    # (StepExchange.shadow), after a wait that needs work before it (the sum, times 0).
    # Adding 1 rounds alike there and in numpy, as XLA may fuse a multiply and an add into
    # one instruction.
    def plus_one(ys):
        work = np.float32(0) * jax.numpy.sum(ys[-1])
        return [y + np.float32(1) + work for y in ys], None

    corrected = jax.jit(lambda xs, c, shadow: inside.correct_during(
        [x + c for x in xs], plus_one, [x + c for x in xs], shadow=shadow)[0])
    resulted = jax.jit(lambda xs, c: inside.average_results(
        results, list(range(len(layout))), *xs, c)[:len(layout)])
    step = jax.jit(lambda xs, c: [x + c for x in xs])
    offsets = list(zip(ex.offsets, ex.sizes, [s for _, s, _ in layout]))
    split = jax.jit(lambda flat: [flat[o:o + n].reshape(s) for o, n, s in offsets])
    return fused, prefix, overlapped, corrected, resulted, step, split


def _corrected_models(models, k, layout, shift):
    """Every rank's model after xla_rounds' corrected round ``k``: the old values shifted,
    plus one, plus the mean minus the old value."""
    olds = [[m + shift(r, k) for m in ms] for r, ms in enumerate(models)]
    means = [model_average([o[t].ravel() for o in olds], "float32").reshape(
        olds[0][t].shape) for t in range(len(layout))]
    return [[(o + np.float32(1)) + (mean - o) for o, mean in zip(os_, means)] for os_ in olds]


def gradient_rounds(ctx, rounds, big=1 << 23, update="affine", wire=None, clip=4.0):
    """A training step's update fed the ranks' mean gradient inside XLA
    (pympgu.xla.StepExchange.average_gradients), checked bit for bit against numpy each round. The
    state is W, b, a big vector, a matrix and their momentum, the same on every rank; each
    rank's gradients are sums of its own data, the matrix's a product of two of its
    arrays (exact in any order, and in TF32). The big vector's gradient waits for a larger
    product, so that the others cross first and the step is cut (pympgu.xla.split.Split). Where
    the plan does not apply (too few bytes under PYMPGU_SPLIT_MIN_BYTES, say), the average of the parameters after
    the update is checked instead, each rank keeping its own momentum. Odd rounds average
    the parameters after no step, through the same group. ``update``: 'squared' reads
    each gradient squared (exact here), an update not affine in its gradients as Adam's
    is not, taken with ``exact=False``: the square of the mean gradient, not the mean of
    the squares; 'clipped' scales the gradients to a 2-norm of at most ``clip`` (Model's
    clip_norm), also with ``exact=False``: by the norm of the mean gradient, or each
    rank's own where the plan does not apply. Its data are small and mostly zero, so
    that the sum of squares is exact in any order (on a power of two of ranks), and numpy's
    model takes the scale of that sum from XLA, whose square root and division are not
    numpy's to the last bit. ``wire`` ('bfloat16' or 'float16'): the gradients cross
    rounded to it, and are summed in float32 (by the kernel: averaged into the wire's dtype); its rounds are
    all steps, since the parameters' own average inside XLA takes no such wire."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from pympgu import xla
    from pympgu.exchange import Exchanger
    from pympgu.xla import StepExchange
    case = _GradientCase(jax.devices("gpu")[ctx.device], big, update, clip)
    n, layout, start = case.n, case.layout, case.start
    models = [list(start) for _ in range(ctx.nranks)]  # every rank's state
    ex = Exchanger(ctx, layout, shadow=True, wire_dtype=wire)
    inside = StepExchange(ex)
    try:
        shadow = inside.shadow(correction=False)
        which, local = list(range(2 * n)), list(range(2 * n, 2 * n + 5))
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in start + case.data(0, 0)]
        exact = update == "affine"
        options = xla.alike_options()  # every rank compiles the update alike, as train's
        why = xla.gradient_plan(case.step, which, ex.backend.group, structs, local, shadow,
                                exact=exact, alike=options is not None)[1]
        stepped = jax.jit(lambda flat, shadow: inside.average_gradients(
            case.step, which, which[:n], *flat, shadow=shadow, local=local, exact=exact,
            alike=options is not None)[:2 * n], compiler_options=options)
        plain = jax.jit(lambda flat: inside.average([a + np.float32(0) for a in flat[:n]]) +
                        list(flat[n:]))
        xs = [jax.device_put(a, case.dev) for a in start]
        for k in range(rounds):
            if k % 2 and not wire:
                xs = plain(xs)
                case.average_params(models)
                continue
            xs = stepped(xs + [jax.device_put(a, case.dev) for a in case.data(ctx.rank, k)],
                         shadow)
            sums = case.expected(ctx.nranks, k, why, wire, "kernel" in inside.road)
            for m, g in zip(models, sums):
                m[n:] = [case.mu * v - gi for v, gi in zip(m[n:], g)]
                m[:n] = [p + v for p, v in zip(m[:n], m[n:])]
            if why is not None:  # the parameters averaged after the update
                case.average_params(models)
            check_bits(xs, models[ctx.rank], layout,
                       f"rank {ctx.rank} round {k} ({why or 'gradients'})")
        # The parameters: every rank's are the same either way.
        digest = hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in xs[:n])).hexdigest()
    finally:
        ex.close()
    return {"digest": digest, "why_not": why, "road": inside.road}


class _GradientCase:
    """gradient_rounds' state, data, step and numpy's model of what the step computes."""
    mu = np.float32(0.5)

    def __init__(self, dev, big, update, clip):
        import jax
        self.dev, self.update, self.clip = dev, update, clip
        self.shapes = [[64, 64], [64], [big], [512, 2048]]
        self.n = len(self.shapes)
        self.layout = ([(f"p{i}", s, "float32") for i, s in enumerate(self.shapes)] +
                       [(f"v{i}", s, "float32") for i, s in enumerate(self.shapes)])
        self.start = (list(rank_params(0, 0, self.layout[:self.n])) +
                      [np.zeros(s, np.float32) for s in self.shapes])
        self.xla_scale = jax.jit(self.scale)

    def average_params(self, models):
        """Every rank's model of the parameters, averaged as the kernels do."""
        means = [model_average([m[i].ravel() for m in models], "float32").reshape(s)
                 for i, s in enumerate(self.shapes)]
        for m in models:
            m[:self.n] = means

    def data(self, rank, k):
        """Quarters of small integers: their sums and products are exact."""
        rng = np.random.default_rng([rank, k, 7])
        top = 4 if self.update == "clipped" else 64
        shapes = self.shapes
        xs = [(rng.integers(-top, top, (4, *s)) * 0.25).astype(np.float32)
              for s in [*shapes[:3], shapes[3][:1], shapes[3][1:]]]
        if self.update == "clipped":  # nonzero in 4 or 16 places along the last axis
            for x, kept in zip(xs, [4, 16, 16, 4, 4]):
                x[..., kept:] = 0
        return xs

    def scale(self, total):
        """Model's clip_norm: the gradients' factor for their sum of squares."""
        import jax.numpy as jnp
        return jnp.minimum(np.float32(1),
                           np.float32(self.clip) / (jnp.sqrt(total) + np.float32(1e-6)))

    def clipped(self, g):
        """``g`` clipped, from a sum of squares exact in any order. Its square root and
        division in XLA's arithmetic, which need not be numpy's to the last bit on GPUs:
        this checks which norm scales the gradients, not them."""
        import jax
        total = np.float32(sum(float(np.sum(np.square(gi, dtype=np.float64))) for gi in g))
        factor = np.asarray(self.xla_scale(jax.device_put(total, self.dev)))
        return [gi * factor for gi in g]

    @staticmethod
    def gradients(xs):
        """numpy's: the rows summed; the matrix's, a product."""
        return [x.sum(axis=0, dtype=np.float32) for x in xs[:3]] + [xs[3].T @ xs[4]]

    def step(self, *flat):
        import jax.numpy as jnp
        n = self.n
        p, v, xs = flat[0:n], flat[n:2 * n], list(flat[2 * n:])
        tiled = jnp.tile(p[0], (8, 8))
        work = jnp.sum((tiled @ tiled) @ tiled.T)
        xs[2] = xs[2] + np.float32(0) * work  # the big gradient waits for the product
        g = [jnp.sum(x, axis=0) for x in xs[:3]] + [xs[3].T @ xs[4]]
        if self.update == "squared":
            g = [gi * gi for gi in g]
        elif self.update == "clipped":
            factor = self.scale(sum(jnp.sum(gi * gi) for gi in g))
            g = [gi * factor for gi in g]
        new_v = [self.mu * vi - gi for vi, gi in zip(v, g)]
        return [pi + vi for pi, vi in zip(p, new_v)] + new_v + [work]

    def expected(self, nranks, k, why, wire, by_kernel):
        """What each rank's update reads in round ``k``: its own gradients where the plan
        does not apply (``why``), else the mean, summed as the road (``by_kernel``) sums."""
        shapes = self.shapes
        sums = [self.gradients(self.data(r, k)) for r in range(nranks)]
        if why is None and wire:
            rounded = [[from_f32(gi.ravel(), wire) for gi in g] for g in sums]

            def mean(i):  # summed in float32 from the wire; by the kernel, into it
                if by_kernel:
                    return to_f32(model_average([g[i] for g in rounded], wire), wire)
                return model_average([to_f32(g[i], wire) for g in rounded], "float32")
            sums = [[mean(i).reshape(s) for i, s in enumerate(shapes)]] * nranks
        elif why is None:  # every rank's update of the mean gradient
            sums = [[model_average([g[i].ravel() for g in sums], "float32").reshape(s)
                     for i, s in enumerate(shapes)]] * nranks
        if self.update == "squared":
            sums = [[gi * gi for gi in g] for g in sums]
        elif self.update == "clipped":
            sums = [self.clipped(g) for g in sums]
        return sums
