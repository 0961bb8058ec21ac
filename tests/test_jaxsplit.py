"""pympgu.jaxsplit: where a training step is cut so that its exchange can start early.

On CPU JAX (in a fresh interpreter, since JAX's platform is chosen at import): the cut
program computes what the program computes, bit for bit; phase 2 starts only after the
exchange has started; and the early results of an MLP are its last layers.
"""
import pytest

from test_train import run_jax_on_cpu

PRELUDE = (
    "import os; os.environ['JAX_PLATFORMS']='cpu';"
    "import numpy as np, jax; from jax import lax;"
    "from pympgu import data, models; from pympgu.xla import split as jaxsplit; from pympgu.xla.step import JaxStep\n"
    "ds = data.load('digits')\n"
    "def traced(hidden, batch, optimizer='sgd', lr=0.05, l1=0, l2=0, **opts):\n"
    "    m = models.MLP(ds.n_in, hidden, ds.n_classes)\n"
    "    m.set_optimizer(optimizer, **opts)\n"
    "    f = m.compile(ds, batch, 100, lr, 0.9, l1, l2, 'JAX')[0]\n"
    "    st = JaxStep(f, m.state)\n"
    "    args = st.arguments(np.arange(batch, dtype=np.int32))\n"
    "    fg = f.maker.fgraph\n"
    "    pos = {id(i.variable): k for k, i in enumerate(f.maker.inputs)}\n"
    "    out_of = {i: o for o, i in fg.update_mapping.items()}\n"
    "    which = [out_of[pos[id(s)]] for s in m.state]  # the new state, in its order\n"
    "    return m, st, args, which, lambda *a: list(f.vm.jit_fn(*a))\n"
    "def step(hidden, batch):  # the program, and where its parameters' new values are\n"
    "    m, st, args, which, compute = traced(hidden, batch)\n"
    "    return m, compute, args, which[:len(m.params)]\n"
)


def test_cut_program_is_the_program():
    """Phase 1, the start, the hold and phase 2 give every output bit for bit, and the start
    sees exactly the early results."""
    pytest.importorskip("jax")
    code = PRELUDE + (
        "m, prog, args, which = step([32, 16], 64)\n"
        "split = jaxsplit.Split(jaxsplit.trace(prog, args), which)\n"
        "assert split.early and split.late, (split.early, split.late)\n"
        "assert sorted(split.early + split.late) == sorted(which)\n"
        "sent = []\n"
        "def start(early):\n"
        "    sent.append([tuple(e.shape) for e in early])\n"
        "    return np.uint32(0)\n"
        "def run(*a):\n"
        "    return split.run(list(a), start, lambda t, v: lax.optimization_barrier((t, v)))[1]\n"
        "cut, whole = jax.jit(run)(*args), prog(*args)\n"
        "assert len(cut) == len(whole)\n"
        "for a, b in zip(cut, whole):\n"
        "    assert np.array_equal(np.asarray(a), np.asarray(b))\n"
        "outs = jax.eval_shape(prog, *args)\n"
        "assert sent == [[tuple(outs[i].shape) for i in split.early]], sent\n"
        "print('same')\n"
    )
    run_jax_on_cpu(code, "same")


def test_phase_two_waits_for_the_start():
    """In the traced program every equation of phase 2 depends on the start's token: XLA
    cannot run any of it before the exchange has started."""
    pytest.importorskip("jax")
    code = PRELUDE + (
        "m, prog, args, which = step([32, 16], 64)\n"
        "split = jaxsplit.Split(jaxsplit.trace(prog, args), which)\n"
        "def run(*a):\n"
        "    tok, outs = split.run(list(a), lambda e: jax.numpy.max(e[0]).astype('uint32'),\n"
        "                          lambda t, v: lax.optimization_barrier((t, v)))\n"
        "    return outs\n"
        "jaxpr = jax.make_jaxpr(run)(*args).jaxpr\n"
        "inner = jaxpr.eqns[0].params['jaxpr'].jaxpr if len(jaxpr.eqns) == 1 else jaxpr\n"
        "names = [e.primitive.name for e in inner.eqns]\n"
        "cut = names.index('optimization_barrier')\n"
        "held = set(inner.eqns[cut].outvars)\n"
        "made = set(held)\n"
        "for e in inner.eqns[cut + 1:]:\n"
        "    reads = [v for v in e.invars if hasattr(v, 'aval') and not hasattr(v, 'val')]\n"
        "    assert all(v in made for v in reads), e\n"
        "    made.update(e.outvars)\n"
        "print('held', len(inner.eqns) - cut - 1)\n"
    )
    run_jax_on_cpu(code, "held")


def test_mlp_sends_its_last_layers_early():
    """784-4096-4096-10 (the wide MLP): the 4096x4096 layer and the ones after it are sent
    while the first layer's gradient (dX through the big layer, then dW0) is computed, about
    a third of the step's FLOPs. Traced only: nothing this size is computed on the CPU."""
    pytest.importorskip("jax")
    code = PRELUDE.replace("ds = data.load('digits')",
                           "ds = data.load('digits'); ds.n_in = 784") + (
        "import pytensor\n"
        "m = models.MLP(784, [4096, 4096], 10)\n"
        "import pytensor.tensor as pt\n"
        "x = pt.matrix('x', dtype='float32'); y = pt.matrix('y', dtype='float32')\n"
        "from pytensor.tensor.special import log_softmax\n"
        "cost = -pt.mean(pt.sum(y * log_softmax(m.logits(x), axis=1), axis=1))\n"
        "g = pytensor.grad(cost, m.params)\n"
        "ups = [(p, p - np.float32(0.1) * d) for p, d in zip(m.params, g)]\n"
        "f = pytensor.function([x, y], cost, updates=ups, mode='JAX')\n"
        "pos = {id(i.variable): k for k, i in enumerate(f.maker.inputs)}\n"
        "out_of = {i: o for o, i in f.maker.fgraph.update_mapping.items()}\n"
        "which = [out_of[pos[id(p)]] for p in m.params]\n"
        "args = [jax.ShapeDtypeStruct((1024, 784), np.float32), jax.ShapeDtypeStruct((1024, 10), np.float32)]\n"
        "args += [jax.ShapeDtypeStruct(p.get_value().shape, np.float32) for p in m.params]\n"
        "split = jaxsplit.Split(jaxsplit.trace(f.vm.jit_fn, args), which)\n"
        "names = [p.name for p in m.params]\n"
        "early = [names[which.index(i)] for i in split.early]\n"
        "assert early == ['W1', 'b1', 'W2', 'b2'], early\n"
        "share = split.flops[1] / sum(split.flops)\n"
        "assert 0.3 < share < 0.4, split.flops\n"
        "print('early', early, round(share, 3))\n"
    )
    run_jax_on_cpu(code, "early")


def test_flops_of_products_convolutions_and_nested_programs():
    """The cost model counts 2 * M * N * K for a matrix product, 2 * outputs * (kernel
    volume / output features) for a convolution, and looks inside nested jitted calls."""
    pytest.importorskip("jax")
    code = (
        "import os; os.environ['JAX_PLATFORMS']='cpu';"
        "import jax, jax.numpy as jnp, numpy as np; from jax import lax; from pympgu.xla import split as jaxsplit\n"
        "def flops(fn, *shapes):\n"
        "    j = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(s, np.float32) for s in shapes]).jaxpr\n"
        "    return sum(jaxsplit._flops(e) for e in j.eqns)\n"
        "assert flops(lambda a, b: a @ b, (8, 16), (16, 4)) == 2 * 8 * 4 * 16\n"
        "conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), 'SAME')\n"
        "assert flops(conv, (2, 3, 10, 10), (5, 3, 3, 3)) == 2 * (2 * 5 * 10 * 10) * (3 * 3 * 3)\n"
        "assert flops(jax.jit(lambda a, b: jnp.tanh(a @ b)), (8, 16), (16, 4)) == 2 * 8 * 4 * 16\n"
        "print('counted')\n"
    )
    run_jax_on_cpu(code, "counted")


def test_tail_is_the_update():
    """The tail of an MLP's new state is its update, elementwise work alone, which reads the
    gradients from before it; before, the hold and the tail give every output bit for bit.
    JaxStep's order of outputs hides the program's equations in one call unless inlined."""
    pytest.importorskip("jax")
    code = PRELUDE + (
        "m, prog, args, which = step([32, 16], 64)\n"
        "def compute(*a):  # as JaxStep's: the new state first, then every output\n"
        "    outs = list(prog(*a))\n"
        "    return [outs[i] for i in which] + outs\n"
        "assert not jaxsplit.Tail(jaxsplit.trace(compute, args), range(len(which))).tail\n"
        "tail = jaxsplit.Tail(jaxsplit.trace(compute, args, inline=True), range(len(which)))\n"
        "names = {e.primitive.name for e in tail.tail}\n"
        "assert names <= jaxsplit.ELEMENTWISE, names\n"
        "assert len(tail.tail) >= 2 * len(which), len(tail.tail)\n"
        "made = {v: e.primitive.name for e in tail.before for v in e.outvars}\n"
        "kinds = sorted(made[v] for v in tail.crossing)\n"
        "assert kinds.count('dot_general') == len(m.weights), kinds\n"
        "assert kinds.count('reduce_sum') >= len(m.weights), kinds\n"
        "seen = []\n"
        "def run(*a):\n"
        "    outs, other = tail.run(list(a), lambda g: (seen.append(len(g)) or g, 0))\n"
        "    return outs\n"
        "cut, whole = jax.jit(run)(*args), compute(*args)\n"
        "assert seen == [len(tail.crossing)]\n"
        "for a, b in zip(cut, whole):\n"
        "    assert np.array_equal(np.asarray(a), np.asarray(b))\n"
        "print('tail', len(tail.tail), kinds)\n"
    )
    run_jax_on_cpu(code, "tail")


@pytest.mark.parametrize("nesterov", [False, True])
def test_tail_in_parts_and_the_gradients_plan(nesterov):
    """The update fed its gradients in two parts (as xla.average_gradients feeds it their
    means: here the values themselves) gives every output bit for bit, the second part's
    function seeing the first part's results; and gradient_plan takes an MLP's SGD update
    (Nesterov's too, as affine in its gradients) with L1 and L2 terms, and names why it
    refuses one that squares a gradient, a new state that a matrix product makes, one that
    reads a rank's own input, too few bytes or the gather algorithm. On 2 ranks with the
    shadow the gradients cross into it; with no shadow, or on 4 ranks, the kernel averages
    them."""
    pytest.importorskip("jax")
    code = PRELUDE + (
        "import os; from types import SimpleNamespace; from pympgu import xla\n"
        f"m, st, args, which, compute = traced([32, 16], 64, l1=1e-5, l2=1e-4,\n"
        f"                                     nesterov={nesterov})\n"
        "group = SimpleNamespace(shadow_offset=4096, nranks=2, rank=0)\n"
        "def plan(fn=compute, local=st.explicit, shadow=object(), g=group):\n"
        "    return xla.gradient_plan(fn, which, g, args, local, shadow)\n"
        "assert 'PYMPGU_SPLIT_MIN_BYTES' in plan()[1], plan()\n"
        "os.environ['PYMPGU_SPLIT_MIN_BYTES'] = '0'; from pympgu import settings; settings.reload()\n"
        "tail, why = plan()\n"
        "assert why is None, why\n"
        "assert len(tail.crossing) == len(m.params), tail.crossing  # one gradient each\n"
        "assert sorted(tail.made()) == sorted(which) and tail.nonlinear() is None\n"
        "n = len(tail.crossing)\n"
        "split = jaxsplit.Split(jaxsplit.trace(lambda *a: tail.evaluate_before(a), args),\n"
        "                       range(n))\n"
        "assert split.early and split.late, (split.early, split.late)\n"
        "seen = []\n"
        "def take(values, earlier):\n"
        "    seen.append((len(values), len(earlier)))\n"
        "    return values\n"
        "def run(*a):\n"
        "    outs = tail.evaluate_before(list(a))\n"
        "    made = tail.evaluate_tail(list(a), outs[:n],\n"
        "                              [(split.early, take), (split.late, take)])\n"
        "    rest = dict(zip(tail.rest(), outs[n:]))\n"
        "    return [rest[k] if k in rest else made[k] for k in range(len(made))]\n"
        "for a, b in zip(jax.jit(run)(*args), compute(*args)):\n"
        "    assert np.array_equal(np.asarray(a), np.asarray(b))\n"
        "assert [s[0] for s in seen] == [len(split.early), len(split.late)], seen\n"
        "assert seen[0][1] == 0 and seen[1][1] > 0, seen\n"
        "def squared(*a):\n"
        "    outs = compute(*a)\n"
        "    return [o * o if i in which else o for i, o in enumerate(outs)]\n"
        "assert 'not affine' in plan(squared)[1], plan(squared)\n"
        "def product(*a):  # a new state that a matrix product makes\n"
        "    outs = compute(*a)\n"
        "    w = outs[which[0]]\n"
        "    outs[which[0]] = w @ np.eye(w.shape[1], dtype=np.float32)\n"
        "    return outs\n"
        "assert 'not computed by an elementwise update' in plan(product)[1], plan(product)\n"
        "mine = [k for k, c in st.shared if c is m.slots[-1].container]\n"
        "assert 'own inputs' in plan(local=st.explicit + mine)[1]  # as if a rank's own\n"
        "four = SimpleNamespace(shadow_offset=4096, nranks=4, rank=0)\n"
        "assert xla.gradients_by_copies(group, object(), 'auto')  # into the shadow\n"
        "for g, shadow in ((group, None), (four, object())):  # by the kernel\n"
        "    assert plan(shadow=shadow, g=g)[1] is None\n"
        "    assert not xla.gradients_by_copies(g, shadow, 'auto')\n"
        "assert not xla.gradients_by_copies(group, object(), 'push')\n"
        "assert 'gather' in xla.gradient_plan(compute, which, group, args, st.explicit,\n"
        "                                     object(), 'gather')[1]\n"
        "print('parts', split.early, split.late)\n"
    )
    run_jax_on_cpu(code, "parts")


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adams_update_takes_the_gradients_road_only_as_ddp(optimizer):
    """Adam's update squares its gradients: gradient_plan refuses it where the road must
    give the replicas' average (exact), and takes it at any size with exact=False, where
    the update reads the mean gradient as DDP's does. What crosses is one gradient per
    parameter; the learning rate (and AdamW's decay, which its weights' update reads
    with the weights) is an input the update reads, the same on every rank, and the cut
    program computes what the program computes, bit for bit."""
    pytest.importorskip("jax")
    code = PRELUDE + (
        "from types import SimpleNamespace; from pympgu import xla\n"
        f"decay = {0.01 if optimizer == 'adamw' else 0}\n"
        f"m, st, args, which, compute = traced([32, 16], 64, {optimizer!r}, 1e-3, 1e-5, 1e-4,\n"
        "                                     weight_decay=decay)\n"
        "group = SimpleNamespace(shadow_offset=4096, nranks=2, rank=0)\n"
        "def plan(exact):\n"
        "    return xla.gradient_plan(compute, which, group, args, st.explicit, object(),\n"
        "                             exact=exact)\n"
        "assert 'not affine in its gradients' in plan(True)[1], plan(True)\n"
        "tail, why = plan(False)  # under PYMPGU_SPLIT_MIN_BYTES too\n"
        "assert why is None and __import__('pympgu.settings').settings.get().split_min_bytes > 0, why\n"
        "assert len(tail.crossing) == len(m.params), tail.crossing\n"
        "assert sorted(v.aval.size for v in tail.crossing) == sorted(\n"
        "    p.get_value().size for p in m.params)\n"
        "assert tail.nonlinear() is not None and sorted(tail.made()) == sorted(which)\n"
        "for var in m.rate_vars:\n"
        "    k = [k for k, c in st.shared if c is var.container]\n"
        "    assert len(k) == 1 and tail.reads(k), var\n"
        "assert len(m.rate_vars) == (2 if m.optimizer == 'adamw' else 1)\n"
        "assert not tail.reads(st.explicit)\n"
        "def run(*a):\n"
        "    outs, _ = tail.run(list(a), lambda crossing: (crossing, None))\n"
        "    return outs\n"
        "for a, b in zip(jax.jit(run)(*args), compute(*args)):\n"
        "    assert np.array_equal(np.asarray(a), np.asarray(b))\n"
        "print('adam', len(tail.crossing))\n"
    )
    run_jax_on_cpu(code, "adam")


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.05), ("adam", 1e-3)])
def test_a_clipped_update_reads_the_norm_of_the_mean_gradient(optimizer, lr):
    """--clip-norm's update scales the gradients by their global norm: gradient_plan refuses
    it where the road must give the replicas' average (exact), as it is not affine in
    them, and takes it with exact=False, where what crosses is one gradient per parameter
    and the norm is computed in the update from what crosses. On GPUs, where each rank's
    XLA may compile the reductions to other kernels, the plan is refused, and says how to
    mend it, unless the step is compiled alike (``alike=True``). Fed two ranks' mean
    gradients, that update is the step on both ranks' minibatches together (DDP's
    clip_grad_norm_ after the all-reduce), to float32's rounding, and far from the mean of
    the two ranks' own clipped steps; fed in two parts it gives the same bits as in one."""
    pytest.importorskip("jax")
    code = PRELUDE + (
        "from types import SimpleNamespace; from pympgu import xla\n"
        "B = 64\n"
        "def clipped(batch):\n"
        f"    return traced([32, 16], batch, {optimizer!r}, {lr}, 0, 1e-4, clip_norm=0.05)\n"
        "m, st, args0, which, compute = clipped(B)\n"
        "args1 = st.arguments(np.arange(B, 2 * B, dtype=np.int32))\n"
        "group = SimpleNamespace(shadow_offset=4096, nranks=2, rank=0)\n"
        "def plan(exact, alike=False):\n"
        "    return xla.gradient_plan(compute, which, group, args0, st.explicit, object(),\n"
        "                             exact=exact, alike=alike)\n"
        "assert 'not affine in its gradients' in plan(True)[1], plan(True)\n"
        "cpu, jax.default_backend = jax.default_backend, lambda: 'gpu'  # as on GPUs\n"
        "why = plan(False)[1]\n"
        "assert 'alike_options()' in why and xla.DETERMINISTIC_FLAG in why, why\n"
        "assert plan(False, alike=True)[1] is None, plan(False, alike=True)\n"
        "jax.default_backend = cpu\n"
        "tail, why = plan(False)\n"
        "assert why is None and not tail.finishing, why\n"
        "n = len(tail.crossing)\n"
        "assert n == len(m.params), tail.crossing  # the gradients alone, not their norms\n"
        "assert 'reduce_sum' in {e.primitive.name for e in tail.tail}\n"
        "g0, g1 = (tail.evaluate_before(a)[:n] for a in (args0, args1))\n"
        "mean = [(a + b) / np.float32(2) for a, b in zip(g0, g1)]\n"
        "def fed(parts):\n"
        "    made = tail.evaluate_tail(args0, mean, [(p, lambda v, e: v) for p in parts])\n"
        "    return [np.asarray(made[i]) for i in which]\n"
        "ddp = fed([range(n)])\n"
        "for a, b in zip(ddp, fed([range(n // 2), range(n // 2, n)])):\n"
        "    assert np.array_equal(a, b)\n"
        "_, st2, _, which2, compute2 = clipped(2 * B)\n"
        "union = compute2(*st2.arguments(np.arange(2 * B, dtype=np.int32)))\n"
        "union = [np.asarray(union[i]) for i in which2]\n"
        "outs0, outs1 = compute(*args0), compute(*args1)\n"
        "own = [(np.asarray(outs0[i]) + np.asarray(outs1[i])) / 2 for i in which]\n"
        "k = len(m.params)  # the optimizer's state: the clipped gradients, scaled\n"
        "for a, b in zip(ddp, union):\n"
        "    assert np.allclose(a, b, rtol=1e-5, atol=1e-8), np.abs(a - b).max()\n"
        "off = max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(own[k:], union[k:]))\n"
        "near = max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(ddp[k:], union[k:]))\n"
        "assert off > 1e-2 and near < 1e-5, (off, near)\n"
        "print('clipped', off, near)\n"
    )
    run_jax_on_cpu(code, "clipped")


def test_the_options_that_compile_a_step_alike_on_every_rank():
    """pympgu.xla.alike_options: none on a CPU, where XLA does not autotune; on GPUs the
    first of ALIKE_OPTIONS that this XLA accepts, tried by compiling with it, since XLA
    refuses an option it does not know (the first is experimental; the last, the
    documented --xla_gpu_exclude_nondeterministic_ops, must be accepted)."""
    pytest.importorskip("jax")
    code = (
        "import os; os.environ['JAX_PLATFORMS'] = 'cpu'\n"
        "from pympgu import xla; from pympgu.xla import alike\n"
        "assert xla.alike_options() == {}\n"
        "assert alike.accepts(alike.ALIKE_OPTIONS[-1])\n"
        "assert not alike.accepts({'xla_gpu_no_such_option': True})\n"
        "print('alike', [alike.accepts(o) for o in alike.ALIKE_OPTIONS])\n"
    )
    run_jax_on_cpu(code, "alike")


def test_work_on_gradients_alone_goes_before_the_tail_where_the_update_is_affine():
    """A gradient that the step finishes in the update's elementwise tail, as a batch norm's
    scale's is (one sum over the batch divided by another): with ``finish`` the division
    goes before the tail, and so does the square of a sum, so that the tail is affine in
    what crosses; without, ``finishing`` names the division but not the square of one
    value (Adam's work). The work on a squeezed parameter (an L2 term's) stays the tail's
    either way."""
    pytest.importorskip("jax")
    code = PRELUDE + (
        "import jax.numpy as jnp\n"
        "def step(p, x, y):\n"
        "    g = (x * y).sum(axis=0) / jnp.sqrt((y * y).sum(axis=0) + 1e-5)\n"
        "    q = p[:, None].squeeze(1)\n"
        "    return [p - 0.1 * g - 0.01 * q, p - 0.1 * (x.sum(axis=0) ** 2)]\n"
        "args = [np.ones(3, np.float32)] + [np.ones((4, 3), np.float32)] * 2\n"
        "closed = jaxsplit.trace(step, args)\n"
        "plain, finished = jaxsplit.Tail(closed, [0, 1]), jaxsplit.Tail(closed, [0, 1], True)\n"
        "def kinds(t):  # what makes the values that cross\n"
        "    return sorted(e.primitive.name for e in t.before\n"
        "                  if set(e.outvars) & set(t.crossing))\n"
        "names = [e.primitive.name for e in plain.finishing]\n"
        "assert 'div' in names and 'integer_pow' not in names, names\n"
        "assert plain.nonlinear() is not None and finished.nonlinear() is None\n"
        "assert finished.finishing == []\n"
        "assert kinds(plain) == ['reduce_sum'] * 3, kinds(plain)\n"
        "assert kinds(finished) == ['div', 'integer_pow'], kinds(finished)\n"
        "for t in (plain, finished):\n"
        "    outs, _ = jax.jit(lambda *a: t.run(list(a), lambda c: (c, None)))(*args)\n"
        "    for a, b in zip(outs, step(*args)):\n"
        "        assert np.array_equal(np.asarray(a), np.asarray(b))\n"
        "print('finish', kinds(plain), kinds(finished))\n"
    )
    run_jax_on_cpu(code, "finish")


@pytest.mark.parametrize("optimizer,dtype", [("sgd", "float32"), ("adam", "float32"),
                                             ("sgd", "bfloat16")])
def test_a_batch_norms_gradients_cross_whole(optimizer, dtype):
    """examples/resnet.py, whose batch norms' scales get their gradients as one sum over the
    batch divided by another (after PyTensor's rewrites): for SGD's update, affine in its
    gradients, that division goes before the update (jaxsplit.Tail's ``finish``), so the
    gradients' road takes it and gives the replicas' average, and the cut program computes
    what the program computes, bit for bit. Adam's road, which must feed its update the
    mean gradients themselves, is refused and named. With bfloat16 products
    (pympgu.precision), whose results the update reads widened, the widening goes before
    the update too: what crosses is float32."""
    pytest.importorskip("jax")
    code = PRELUDE + (
        "import os; from types import SimpleNamespace; from pympgu import xla, precision\n"
        "m = models.build(os.path.join('examples', 'resnet.py:ResNet'), ds.n_in, [4, 8],\n"
        f"                 ds.n_classes, optimizer={optimizer!r})\n"
        f"f = m.compile(ds, 32, 100, 0.05, 0.9, 0, 1e-4, precision.mode({dtype!r}))[0]\n"
        "st = JaxStep(f, m.state)\n"
        "args = st.arguments(np.arange(32, dtype=np.int32))\n"
        "pos = {id(i.variable): k for k, i in enumerate(f.maker.inputs)}\n"
        "out_of = {i: o for o, i in f.maker.fgraph.update_mapping.items()}\n"
        "which = [out_of[pos[id(s)]] for s in m.state]\n"
        "compute = lambda *a: list(f.vm.jit_fn(*a))\n"
        "group = SimpleNamespace(shadow_offset=4096, nranks=2, rank=0)\n"
        "os.environ['PYMPGU_SPLIT_MIN_BYTES'] = '0'; from pympgu import settings; settings.reload()\n"
        "tail, why = xla.gradient_plan(compute, which, group, args, st.explicit, object(),\n"
        f"                              exact={optimizer == 'sgd'})\n"
        f"if {optimizer == 'adam'}:\n"
        "    assert why == ('the update reads parts of its gradients, not the gradients '\n"
        "                   '(div of two)'), why\n"
        "    raise SystemExit(print('norms refused'))\n"
        "assert why is None and tail.nonlinear() is None and not tail.finishing, why\n"
        "assert {str(v.aval.dtype) for v in tail.crossing} == {'float32'}\n"
        "made = {v: e.primitive.name for e in tail.before for v in e.outvars}\n"
        f"if {dtype == 'bfloat16'}:\n"
        "    assert 'convert_element_type' in made.values(), made\n"
        "assert 'div' in {made[v] for v in tail.crossing}, tail.crossing\n"
        "def run(*a):\n"
        "    outs, _ = tail.run(list(a), lambda crossing: (crossing, None))\n"
        "    return outs\n"
        "for a, b in zip(jax.jit(run)(*args), compute(*args)):\n"
        "    assert np.array_equal(np.asarray(a), np.asarray(b))\n"
        "print('norms', len(tail.crossing))\n"
    )
    run_jax_on_cpu(code, "norms")
