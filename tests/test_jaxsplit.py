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
    "from pympgu import data, models, jaxsplit; from pympgu.jaxstep import JaxStep\n"
    "ds = data.load('digits')\n"
    "def step(hidden, batch):\n"
    "    m = models.MLP(ds.n_in, hidden, ds.n_classes)\n"
    "    f = m.compile(ds, batch, 100, 0.05, 0.9, 0, 0, 'JAX')[0]\n"
    "    st = JaxStep(f, m.state)\n"
    "    args = st.arguments(np.arange(batch, dtype=np.int32))\n"
    "    fg = f.maker.fgraph\n"
    "    pos = {id(i.variable): k for k, i in enumerate(f.maker.inputs)}\n"
    "    out_of = {i: o for o, i in fg.update_mapping.items()}\n"
    "    which = [out_of[pos[id(p)]] for p in m.params]\n"
    "    return m, f.vm.jit_fn, args, which\n"
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
        "import jax, jax.numpy as jnp, numpy as np; from jax import lax; from pympgu import jaxsplit\n"
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
