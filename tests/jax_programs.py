"""The bodies of the tests of pympgu.xla.split, gradient_plan and the step programs, on CPU JAX.

Each runs in a fresh process through conftest's ``cpu_jax`` fixture: JAX chooses its
platform when it is first imported, so the process starts with ``JAX_PLATFORMS=cpu``, and
JAX is imported here inside the functions alone.
"""
import os
from types import SimpleNamespace

import numpy as np

from pympgu import settings

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _split_min_bytes(value):
    """Set PYMPGU_SPLIT_MIN_BYTES for this process from here on."""
    os.environ["PYMPGU_SPLIT_MIN_BYTES"] = str(value)
    settings.reload()


def traced(hidden, batch, optimizer="sgd", lr=0.05, l1=0, l2=0, **opts):
    """An MLP on scikit-learn's digits compiled for JAX: (model, its JaxStep, the step's
    arguments, the positions of the new state among its outputs, the program)."""
    from pympgu import data, models
    from pympgu.xla.step import JaxStep
    ds = data.load("digits")
    m = models.MLP(ds.n_in, hidden, ds.n_classes)
    m.set_optimizer(optimizer, **opts)
    f = m.compile(ds, batch, 100, lr, 0.9, l1, l2, "JAX")[0]
    st = JaxStep(f, m.state)
    args = st.arguments(np.arange(batch, dtype=np.int32))
    pos = {id(i.variable): k for k, i in enumerate(f.maker.inputs)}
    out_of = {i: o for o, i in f.maker.fgraph.update_mapping.items()}
    which = [out_of[pos[id(s)]] for s in m.state]  # the new state, in its order
    return m, st, args, which, lambda *a: list(f.vm.jit_fn(*a))


def step(hidden, batch):
    """The program, and where its parameters' new values are."""
    m, st, args, which, compute = traced(hidden, batch)
    return m, compute, args, which[:len(m.params)]


def same_bits(got, want):
    for a, b in zip(got, want):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def cut_program_is_the_program():
    import jax
    from jax import lax

    from pympgu.xla import split as jaxsplit
    m, prog, args, which = step([32, 16], 64)
    split = jaxsplit.Split(jaxsplit.trace(prog, args), which)
    assert split.early and split.late, (split.early, split.late)
    assert sorted(split.early + split.late) == sorted(which)
    sent = []

    def start(early):
        sent.append([tuple(e.shape) for e in early])
        return np.uint32(0)

    def run(*a):
        return split.run(list(a), start, lambda t, v: lax.optimization_barrier((t, v)))[1]
    cut, whole = jax.jit(run)(*args), prog(*args)
    assert len(cut) == len(whole)
    same_bits(cut, whole)
    outs = jax.eval_shape(prog, *args)
    assert sent == [[tuple(outs[i].shape) for i in split.early]], sent


def phase_two_waits_for_the_start():
    import jax
    from jax import lax

    from pympgu.xla import split as jaxsplit
    m, prog, args, which = step([32, 16], 64)
    split = jaxsplit.Split(jaxsplit.trace(prog, args), which)

    def run(*a):
        tok, outs = split.run(list(a), lambda e: jax.numpy.max(e[0]).astype("uint32"),
                              lambda t, v: lax.optimization_barrier((t, v)))
        return outs
    jaxpr = jax.make_jaxpr(run)(*args).jaxpr
    inner = jaxpr.eqns[0].params["jaxpr"].jaxpr if len(jaxpr.eqns) == 1 else jaxpr
    names = [e.primitive.name for e in inner.eqns]
    cut = names.index("optimization_barrier")
    made = set(inner.eqns[cut].outvars)
    for e in inner.eqns[cut + 1:]:
        reads = [v for v in e.invars if hasattr(v, "aval") and not hasattr(v, "val")]
        assert all(v in made for v in reads), e
        made.update(e.outvars)
    return len(inner.eqns) - cut - 1


def mlp_sends_its_last_layers_early():
    import jax
    import pytensor
    import pytensor.tensor as pt
    from pytensor.tensor.special import log_softmax

    from pympgu import models
    from pympgu.xla import split as jaxsplit
    m = models.MLP(784, [4096, 4096], 10)
    x = pt.matrix("x", dtype="float32")
    y = pt.matrix("y", dtype="float32")
    cost = -pt.mean(pt.sum(y * log_softmax(m.logits(x), axis=1), axis=1))
    g = pytensor.grad(cost, m.params)
    ups = [(p, p - np.float32(0.1) * d) for p, d in zip(m.params, g)]
    f = pytensor.function([x, y], cost, updates=ups, mode="JAX")
    pos = {id(i.variable): k for k, i in enumerate(f.maker.inputs)}
    out_of = {i: o for o, i in f.maker.fgraph.update_mapping.items()}
    which = [out_of[pos[id(p)]] for p in m.params]
    args = [jax.ShapeDtypeStruct((1024, 784), np.float32),
            jax.ShapeDtypeStruct((1024, 10), np.float32)]
    args += [jax.ShapeDtypeStruct(p.get_value().shape, np.float32) for p in m.params]
    split = jaxsplit.Split(jaxsplit.trace(f.vm.jit_fn, args), which)
    names = [p.name for p in m.params]
    early = [names[which.index(i)] for i in split.early]
    assert early == ["W1", "b1", "W2", "b2"], early
    share = split.flops[1] / sum(split.flops)
    assert 0.3 < share < 0.4, split.flops


def flops_counted():
    import jax
    import jax.numpy as jnp
    from jax import lax

    from pympgu.xla import split as jaxsplit

    def flops(fn, *shapes):
        j = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(s, np.float32) for s in shapes]).jaxpr
        return sum(jaxsplit._flops(e) for e in j.eqns)
    assert flops(lambda a, b: a @ b, (8, 16), (16, 4)) == 2 * 8 * 4 * 16

    def conv(x, k):
        return lax.conv_general_dilated(x, k, (1, 1), "SAME")
    assert flops(conv, (2, 3, 10, 10), (5, 3, 3, 3)) == 2 * (2 * 5 * 10 * 10) * (3 * 3 * 3)
    assert flops(jax.jit(lambda a, b: jnp.tanh(a @ b)), (8, 16), (16, 4)) == 2 * 8 * 4 * 16


def tail_is_the_update():
    import jax

    from pympgu.xla import split as jaxsplit
    m, prog, args, which = step([32, 16], 64)

    def compute(*a):  # as JaxStep's: the new state first, then every output
        outs = list(prog(*a))
        return [outs[i] for i in which] + outs
    assert not jaxsplit.Tail(jaxsplit.trace(compute, args), range(len(which))).tail
    tail = jaxsplit.Tail(jaxsplit.trace(compute, args, inline=True), range(len(which)))
    names = {e.primitive.name for e in tail.tail}
    assert names <= jaxsplit.ELEMENTWISE, names
    assert len(tail.tail) >= 2 * len(which), len(tail.tail)
    made = {v: e.primitive.name for e in tail.before for v in e.outvars}
    kinds = sorted(made[v] for v in tail.crossing)
    assert kinds.count("dot_general") == len(m.weights), kinds
    assert kinds.count("reduce_sum") >= len(m.weights), kinds
    seen = []

    def run(*a):
        outs, other = tail.run(list(a), lambda g: (seen.append(len(g)) or g, 0))
        return outs
    cut, whole = jax.jit(run)(*args), compute(*args)
    assert seen == [len(tail.crossing)]
    same_bits(cut, whole)


def tail_in_parts_and_the_gradients_plan(nesterov):
    import jax

    from pympgu import xla
    from pympgu.xla import split as jaxsplit
    m, st, args, which, compute = traced([32, 16], 64, l1=1e-5, l2=1e-4, nesterov=nesterov)
    group = SimpleNamespace(shadow_offset=4096, nranks=2, rank=0)

    def plan(fn=compute, local=st.explicit, shadow=object(), g=group):
        return xla.gradient_plan(fn, which, g, args, local, shadow)
    assert "PYMPGU_SPLIT_MIN_BYTES" in plan()[1], plan()
    _split_min_bytes(0)
    tail, why = plan()
    assert why is None, why
    assert len(tail.crossing) == len(m.params), tail.crossing  # one gradient each
    assert sorted(tail.made()) == sorted(which) and tail.nonlinear() is None
    n = len(tail.crossing)
    split = jaxsplit.Split(jaxsplit.trace(lambda *a: tail.evaluate_before(a), args), range(n))
    assert split.early and split.late, (split.early, split.late)
    seen = []

    def take(values, earlier):
        seen.append((len(values), len(earlier)))
        return values

    def run(*a):
        outs = tail.evaluate_before(list(a))
        made = tail.evaluate_tail(list(a), outs[:n], [(split.early, take), (split.late, take)])
        rest = dict(zip(tail.rest(), outs[n:]))
        return [rest[k] if k in rest else made[k] for k in range(len(made))]
    same_bits(jax.jit(run)(*args), compute(*args))
    assert [s[0] for s in seen] == [len(split.early), len(split.late)], seen
    assert seen[0][1] == 0 and seen[1][1] > 0, seen

    def squared(*a):
        outs = compute(*a)
        return [o * o if i in which else o for i, o in enumerate(outs)]
    assert "not affine" in plan(squared)[1], plan(squared)

    def product(*a):  # a new state that a matrix product makes
        outs = compute(*a)
        w = outs[which[0]]
        outs[which[0]] = w @ np.eye(w.shape[1], dtype=np.float32)
        return outs
    assert "not computed by an elementwise update" in plan(product)[1], plan(product)
    mine = [k for k, c in st.shared if c is m.slots[-1].container]
    assert "own inputs" in plan(local=st.explicit + mine)[1]  # as if a rank's own
    four = SimpleNamespace(shadow_offset=4096, nranks=4, rank=0)
    assert xla.gradients_by_copies(group, object(), "auto")  # into the shadow
    for g, shadow in ((group, None), (four, object())):  # by the kernel
        assert plan(shadow=shadow, g=g)[1] is None
        assert not xla.gradients_by_copies(g, shadow, "auto")
    assert not xla.gradients_by_copies(group, object(), "push")
    assert "gather" in xla.gradient_plan(compute, which, group, args, st.explicit, object(),
                                         "gather")[1]


def adams_update_takes_the_gradients_road(optimizer):
    import jax

    from pympgu import xla
    decay = 0.01 if optimizer == "adamw" else 0
    m, st, args, which, compute = traced([32, 16], 64, optimizer, 1e-3, 1e-5, 1e-4,
                                         weight_decay=decay)
    group = SimpleNamespace(shadow_offset=4096, nranks=2, rank=0)

    def plan(exact):
        return xla.gradient_plan(compute, which, group, args, st.explicit, object(),
                                 exact=exact)
    assert "not affine in its gradients" in plan(True)[1], plan(True)
    tail, why = plan(False)  # under PYMPGU_SPLIT_MIN_BYTES too
    assert why is None and settings.get().split_min_bytes > 0, why
    assert len(tail.crossing) == len(m.params), tail.crossing
    assert sorted(v.aval.size for v in tail.crossing) == sorted(
        p.get_value().size for p in m.params)
    assert tail.nonlinear() is not None and sorted(tail.made()) == sorted(which)
    for var in m.rate_vars:
        k = [k for k, c in st.shared if c is var.container]
        assert len(k) == 1 and tail.reads(k), var
    assert len(m.rate_vars) == (2 if m.optimizer == "adamw" else 1)
    assert not tail.reads(st.explicit)

    def run(*a):
        outs, _ = tail.run(list(a), lambda crossing: (crossing, None))
        return outs
    same_bits(jax.jit(run)(*args), compute(*args))


def clipped_update_reads_the_norm_of_the_mean_gradient(optimizer, lr):
    import jax

    from pympgu import xla
    batch = 64

    def clipped(size):
        return traced([32, 16], size, optimizer, lr, 0, 1e-4, clip_norm=0.05)
    m, st, args0, which, compute = clipped(batch)
    args1 = st.arguments(np.arange(batch, 2 * batch, dtype=np.int32))
    group = SimpleNamespace(shadow_offset=4096, nranks=2, rank=0)

    def plan(exact, alike=False):
        return xla.gradient_plan(compute, which, group, args0, st.explicit, object(),
                                 exact=exact, alike=alike)
    assert "not affine in its gradients" in plan(True)[1], plan(True)
    cpu, jax.default_backend = jax.default_backend, lambda: "gpu"  # as on GPUs
    why = plan(False)[1]
    assert "alike_options()" in why and xla.DETERMINISTIC_FLAG in why, why
    assert plan(False, alike=True)[1] is None, plan(False, alike=True)
    jax.default_backend = cpu
    tail, why = plan(False)
    assert why is None and not tail.finishing, why
    n = len(tail.crossing)
    assert n == len(m.params), tail.crossing  # the gradients alone, not their norms
    assert "reduce_sum" in {e.primitive.name for e in tail.tail}
    g0, g1 = (tail.evaluate_before(a)[:n] for a in (args0, args1))
    mean = [(a + b) / np.float32(2) for a, b in zip(g0, g1)]

    def fed(parts):
        made = tail.evaluate_tail(args0, mean, [(p, lambda v, e: v) for p in parts])
        return [np.asarray(made[i]) for i in which]
    ddp = fed([range(n)])
    same_bits(ddp, fed([range(n // 2), range(n // 2, n)]))
    _, st2, _, which2, compute2 = clipped(2 * batch)
    union = compute2(*st2.arguments(np.arange(2 * batch, dtype=np.int32)))
    union = [np.asarray(union[i]) for i in which2]
    outs0, outs1 = compute(*args0), compute(*args1)
    own = [(np.asarray(outs0[i]) + np.asarray(outs1[i])) / 2 for i in which]
    k = len(m.params)  # the optimizer's state: the clipped gradients, scaled
    for a, b in zip(ddp, union):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-8), np.abs(a - b).max()
    off = max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(own[k:], union[k:]))
    near = max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(ddp[k:], union[k:]))
    assert off > 1e-2 and near < 1e-5, (off, near)


def alike_options():
    from pympgu import xla
    from pympgu.xla import alike
    assert xla.alike_options() == {}
    assert alike.accepts(alike.ALIKE_OPTIONS[-1])
    assert not alike.accepts({"xla_gpu_no_such_option": True})


def work_on_gradients_alone_goes_before_the_tail():
    import jax
    import jax.numpy as jnp

    from pympgu.xla import split as jaxsplit

    def program(p, x, y):
        g = (x * y).sum(axis=0) / jnp.sqrt((y * y).sum(axis=0) + 1e-5)
        q = p[:, None].squeeze(1)
        return [p - 0.1 * g - 0.01 * q, p - 0.1 * (x.sum(axis=0) ** 2)]
    args = [np.ones(3, np.float32)] + [np.ones((4, 3), np.float32)] * 2
    closed = jaxsplit.trace(program, args)
    plain, finished = jaxsplit.Tail(closed, [0, 1]), jaxsplit.Tail(closed, [0, 1], True)

    def kinds(t):  # what makes the values that cross
        return sorted(e.primitive.name for e in t.before if set(e.outvars) & set(t.crossing))
    names = [e.primitive.name for e in plain.finishing]
    assert "div" in names and "integer_pow" not in names, names
    assert plain.nonlinear() is not None and finished.nonlinear() is None
    assert finished.finishing == []
    assert kinds(plain) == ["reduce_sum"] * 3, kinds(plain)
    assert kinds(finished) == ["div", "integer_pow"], kinds(finished)
    for t in (plain, finished):
        outs, _ = jax.jit(lambda *a: t.run(list(a), lambda c: (c, None)))(*args)
        same_bits(outs, program(*args))


def batch_norms_gradients_cross_whole(optimizer, dtype):
    import jax

    from pympgu import data, models, precision, xla
    from pympgu.xla.step import JaxStep
    ds = data.load("digits")
    m = models.build(os.path.join(EXAMPLES, "resnet.py:ResNet"), ds.n_in, [4, 8],
                     ds.n_classes, optimizer=optimizer)
    f = m.compile(ds, 32, 100, 0.05, 0.9, 0, 1e-4, precision.mode(dtype))[0]
    st = JaxStep(f, m.state)
    args = st.arguments(np.arange(32, dtype=np.int32))
    pos = {id(i.variable): k for k, i in enumerate(f.maker.inputs)}
    out_of = {i: o for o, i in f.maker.fgraph.update_mapping.items()}
    which = [out_of[pos[id(s)]] for s in m.state]

    def compute(*a):
        return list(f.vm.jit_fn(*a))
    group = SimpleNamespace(shadow_offset=4096, nranks=2, rank=0)
    _split_min_bytes(0)
    tail, why = xla.gradient_plan(compute, which, group, args, st.explicit, object(),
                                  exact=optimizer == "sgd")
    if optimizer == "adam":
        assert why == ("the update reads parts of its gradients, not the gradients "
                       "(div of two)"), why
        return "refused"
    assert why is None and tail.nonlinear() is None and not tail.finishing, why
    assert {str(v.aval.dtype) for v in tail.crossing} == {"float32"}
    made = {v: e.primitive.name for e in tail.before for v in e.outvars}
    if dtype == "bfloat16":
        assert "convert_element_type" in made.values(), made
    assert "div" in {made[v] for v in tail.crossing}, tail.crossing

    def run(*a):
        outs, _ = tail.run(list(a), lambda crossing: (crossing, None))
        return outs
    same_bits(jax.jit(run)(*args), compute(*args))
    return "crossed"


def jax_graph_agrees_with_c_backend(optimizer, lr):
    """One MLP, compiled by PyTensor's own backend and by JAX: three steps' costs, the
    state and the errors agree."""
    from pympgu import data, models
    ds = data.load()
    idx = np.arange(64, dtype=np.int32)
    out = {}
    for mode in ("FAST_RUN", "JAX"):
        m = models.MLP(ds.n_in, [32, 16], 10)
        m.set_optimizer(optimizer, weight_decay=0.1 if optimizer == "adamw" else 0)
        tr, ev = m.compile(ds, 64, 100, lr, 0.9, 1e-5, 1e-4, mode)
        costs = [float(tr(idx)) for _ in range(3)]
        out[mode] = (costs, [np.asarray(p.get_value()) for p in m.state],
                     models.error_rates(ev, 1000, 1000, 100))
    (c1, p1, e1), (c2, p2, e2) = out["FAST_RUN"], out["JAX"]
    assert np.allclose(c1, c2, rtol=1e-5), (c1, c2)
    # Adam moves a parameter by up to lr a step whatever its gradient's size, so the last
    # bits of a gradient near zero (XLA's and the C backend's sums differ there) can move it
    # by a small part of lr.
    atol = 1e-6 if optimizer == "sgd" else 1e-3 * lr
    assert all(np.allclose(a, b, rtol=1e-4, atol=atol) for a, b in zip(p1, p2))
    assert abs(e1[0] - e2[0]) < 0.005, (e1, e2)


def direct_jax_step_matches_pytensor_call():
    from pympgu import data, models
    from pympgu.xla.step import JaxStep
    ds = data.load("digits")
    rng = np.random.default_rng(0)
    seen = []

    def make():
        m = models.MLP(ds.n_in, [32, 16], ds.n_classes)
        return m, m.compile(ds, 64, 100, 0.05, 0.9, 1e-5, 1e-4, "JAX")[0]
    (m1, f1), (m2, f2) = make(), make()

    def halve(compute, which, *args, local=()):
        assert [args[k].dtype for k in local] == [np.int32], local  # the minibatch
        outs = compute(*args)
        seen.append([tuple(outs[i].shape) for i in which])
        return [x * np.float32(0.5) if i in which else x for i, x in enumerate(outs)]

    def during(old, compute, *args):
        seen.append([tuple(x.shape) for x in old])
        new, outs = compute(*args)
        return [n + ((o + np.float32(1)) - o) for n, o in zip(new, old[:2])], outs
    plain, fused = JaxStep(f2, m2.state), JaxStep(f2, m2.state, halve)
    overlapped = JaxStep(f2, m2.state, during=during)
    for k in range(6):
        idx = rng.integers(0, len(ds.train[1]), 64).astype(np.int32)
        old = [np.asarray(s.get_value()) for s in m1.state]
        c1, c2 = f1(idx), {3: fused, 4: overlapped}.get(k, plain)(idx)
        assert float(c1) == float(c2), (k, c1, c2)
        if k == 3:
            for s in m1.state:
                s.set_value(np.asarray(s.get_value()) * np.float32(0.5))
        if k == 4:
            for s, o in zip(m1.state[:2], old):
                s.set_value(np.asarray(s.get_value()) + ((o + np.float32(1)) - o))
    for a, b in zip(m1.state, m2.state):
        assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())), a.name
    assert seen == [[tuple(s.get_value().shape) for s in m2.state]] * 2, seen


def replica_corrects_the_part_it_averages():
    from pympgu.training import replica
    from pympgu.training.config import RunConfig
    cfg = RunConfig(backend="jax", hidden=[32], batch_size=64)
    ctx = SimpleNamespace(device=None, rank=0, nranks=1, is_cpu=True)

    class Inside:  # a StepExchange whose average is old + 1
        def shadow(self):
            return None

        def correct_during(self, arrays, fn, *args, shadow=None, ready=()):
            assert len(arrays) + len(ready) == 8  # the rest of the state need not wait
            new, extra = fn(*args)
            return [f + ((a + np.float32(1)) - a) for f, a in zip(new, arrays)], extra
    idx = np.arange(64, dtype=np.int32)
    for part in ("params", "momentum", "state"):
        reps = [replica.Replica(ctx, cfg) for _ in range(2)]
        for r in reps:
            r.step(idx)  # a momentum that is not zero
        old = [np.asarray(v) for v in reps[1].values()]
        reps[0].step(idx)
        reps[1].step(idx, Inside(), part, overlap=True)
        lo, hi = reps[1].part(part)
        for k, (a, b, o) in enumerate(zip(reps[0].values(), reps[1].values(), old)):
            a, b = np.asarray(a), np.asarray(b)
            want = a + ((o + np.float32(1)) - o) if lo <= k < hi else a
            assert np.array_equal(b, want), (part, k)


def noise_costs(backend, dropout):
    """A rank's step gives the same cost for the same (rank, epoch) of --seed, and another
    for another rank or epoch where it draws."""
    from pympgu.training import replica
    from pympgu.training.config import RunConfig
    cfg = RunConfig(backend=backend, hidden=[64], batch_size=64, dropout=dropout, seed=7)
    idx = np.arange(64, dtype=np.int32)

    def cost(rank, epoch):
        ctx = SimpleNamespace(device=None, rank=rank, nranks=2, is_cpu=True)
        rep = replica.Replica(ctx, cfg)
        rep.seed_noise(epoch)
        return [float(rep.step(idx)) for _ in range(2)]
    a, again, other_rank, other_epoch = cost(0, 0), cost(0, 0), cost(1, 0), cost(0, 1)
    assert a == again, (a, again)
    if dropout:  # the second step's cost: the first's is log(10), the output layer at zero
        assert a[1] != other_rank[1] and a[1] != other_epoch[1], (a, other_rank, other_epoch)
    else:
        assert a == other_rank == other_epoch


def noise_is_a_ranks_own_input():
    from pympgu import data, models
    from pympgu.xla.step import JaxStep
    ds = data.load()
    seen = []

    def make():
        m = models.build(None, ds.n_in, [32], ds.n_classes, dropout=0.5)
        return m, m.compile(ds, 64, 100, 0.05, 0.9, 0, 1e-4, "JAX")[0]
    (m1, f1), (m2, f2) = make(), make()

    def exchange(compute, which, *args, local=()):
        outs = compute(*args)
        seen.append(([str(args[k].dtype) for k in local], [tuple(outs[i].shape) for i in which]))
        return outs
    step = JaxStep(f2, m2.state, exchange)
    idx = np.arange(64, dtype=np.int32)
    for k in range(3):
        assert float(f1(idx)) == float(step(idx)), k
    for a, b in zip(m1.state, m2.state):
        assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())), a.name
    local, shapes = seen[0]
    assert len(seen) == 1 and local[0] == "int32" and "uint32" in local, seen
    assert shapes == [tuple(s.get_value().shape) for s in m2.state], shapes


def augment_flips_and_shifts(mode):
    import pytensor
    import pytensor.tensor as pt

    from pympgu.nnet import augment
    x = pt.tensor("x", dtype="float32", shape=(64, 3, 8, 7))
    f = pt.tensor("f", dtype="float32", shape=(64,))
    o = pt.tensor("o", dtype="float32", shape=(64, 2))
    fn = pytensor.function([x, f, o], augment(x, f, 2, o), mode=mode)
    rng = np.random.default_rng(0)
    xv = rng.normal(size=(64, 3, 8, 7)).astype(np.float32)
    fv, ov = rng.random(64).astype(np.float32), rng.random((64, 2)).astype(np.float32)
    out, moves = np.asarray(fn(xv, fv, ov)), set()
    for b in range(64):
        image = xv[b][:, :, ::-1] if fv[b] < 0.5 else xv[b]
        padded = np.pad(image, ((0, 0), (2, 2), (2, 2)))
        dy, dx = np.floor(ov[b] * 5).astype(int)
        assert np.array_equal(out[b], padded[:, dy:dy + 8, dx:dx + 7]), b
        moves.add((dy, dx, fv[b] < 0.5))
    assert len(moves) > 30, moves  # of 5 x 5 x 2


def convolutions_agree(platform):
    """pympgu.nnet's layers and their gradients compiled by JAX (on ``platform``) against
    PyTensor's own backend (numpy), for every geometry."""
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.devices()[0].platform == ("gpu" if platform == "cuda" else "cpu"), jax.devices()
    import pytensor
    import pytensor.tensor as pt

    from pympgu import nnet
    rng = np.random.default_rng(3)
    # One function of every geometry's layer, compiled once by each backend.
    geometries = [((0, 0), 1, 1), ((2, 1), 1, 1), ((1, 0), 2, 1), ((1, 1), (2, 3), (2, 1))]
    x = pt.tensor("x", dtype="float32", shape=(4, 3, 11, 9))
    outs = []
    for geometry in geometries:
        w = pytensor.shared(rng.standard_normal((5, 3, 5, 3)).astype(np.float32))
        y = nnet.conv2d(x, w, *geometry)
        cost = (nnet.max_pool_2d(pt.tanh(y), 2) ** 2).sum()
        outs += [y, *pytensor.grad(cost, [x, w])]
    xv = rng.standard_normal((4, 3, 11, 9)).astype(np.float32)
    a, b = ([np.asarray(o) for o in pytensor.function([x], outs, mode=m)(xv)]
            for m in ("FAST_RUN", "JAX"))
    for k, (u, v) in enumerate(zip(a, b)):
        assert u.shape == v.shape and np.allclose(u, v, rtol=1e-4, atol=1e-4 * abs(u).max()), \
            (geometries[k // 3], ("y", "gx", "gw")[k % 3], abs(u - v).max())
