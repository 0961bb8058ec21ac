"""--compute-dtype bfloat16 (pympgu.precision): the traced program's products and convolutions
rewritten to bfloat16, on CPU JAX; training with it on CPU workers, and its flag's checks
(the GPU's run is in test_gpu_runtime)."""
import numpy as np
import pytest

from pympgu import precision
from pympgu.training import cli
from pympgu.training.config import RunConfig
from pympgu.training.launcher import run as train

pytestmark = pytest.mark.timeout(600)

jax = pytest.importorskip("jax")
jnp = jax.numpy


def rounded(x):
    """x's values rounded to bfloat16, as float64."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)).astype(np.float64)


def data(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def dtypes_of(fn, *args):
    """The dtypes of the operands of every product and convolution in fn's traced program,
    looking inside the programs it calls."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for param in eqn.params.values():
                for p in param if isinstance(param, tuple) else (param,):  # cond's branches
                    inner = getattr(p, "jaxpr", p)
                    if hasattr(inner, "eqns"):
                        walk(inner)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_a_product_reads_and_returns_bfloat16_values_as_float32():
    a, b = data((64, 96), (96, 32))
    got = np.asarray(precision.autocast(lambda a, b: a @ b, "bfloat16")(a, b))
    assert got.dtype == np.float32
    # Accumulated in float32, then rounded: every value is a bfloat16, within one of
    # its units in the last place of the product of the rounded operands.
    want = rounded(a) @ rounded(b)
    assert np.array_equal(got, rounded(got))
    assert np.all(np.abs(got - want) <= np.abs(want) * 2.0 ** -8 + 1e-30)
    # And not the float32 product: the rewrite happened.
    assert np.abs(got - a.astype(np.float64) @ b).max() > 1e-3


def test_products_inside_jitted_functions_custom_derivatives_and_gradients_are_rewritten():
    w, x = data((8, 8), (4, 8))

    @jax.jit
    def inner(h, w):
        return jnp.dot(h, w)

    def loss(w, x):
        return jnp.sum(jax.nn.relu(inner(x, w)) @ w.T)  # relu: a custom_jvp

    cast = precision.autocast(jax.value_and_grad(loss), "bfloat16")
    assert dtypes_of(jax.value_and_grad(loss), w, x)  # products to rewrite
    assert set(dtypes_of(cast, w, x)) == {("bfloat16", "bfloat16")}
    value, grad = cast(w, x)
    want_value, want_grad = jax.value_and_grad(loss)(w, x)
    assert grad.dtype == np.float32 and value.dtype == np.float32
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=0.05, atol=0.05)
    assert not np.array_equal(np.asarray(grad), np.asarray(want_grad))


def test_products_inside_loops_and_conditionals_are_rewritten():
    """lax.scan (a constant closed over too), fori_loop (a while) and cond: every product
    inside reads bfloat16, and the function computes what it computes with its products
    so rounded, jitted and differentiated as well."""
    w, xs = data((4, 4), (5, 4), seed=2)
    w = w / 2
    bias = np.linspace(-1, 1, 4).astype(np.float32)  # a constant of the loop's program

    def fn(w, xs):
        def body(h, x):
            h = jnp.tanh(h @ w + x + bias)
            return h, h.sum()
        h, ys = jax.lax.scan(body, jnp.zeros(4, jnp.float32), xs)
        z = jax.lax.cond(ys.sum() > 0, lambda: h @ w, lambda: h @ w.T)
        return jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), z)

    cast = precision.autocast(fn, "bfloat16")
    found = dtypes_of(cast, w, xs)
    assert len(found) == 4 and set(found) == {("bfloat16", "bfloat16")}, found

    def by_hand(w, xs):  # the same, rounding each product's operands and result
        def mm(a, b):
            return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                           preferred_element_type=jnp.bfloat16).astype(jnp.float32)
        h = jnp.zeros(4, jnp.float32)
        ys = []
        for x in xs:
            h = jnp.tanh(mm(h, w) + x + bias)
            ys.append(h.sum())
        z = mm(h, w) if sum(ys) > 0 else mm(h, w.T)
        for _ in range(3):
            z = jnp.tanh(mm(z, w))
        return z

    got = np.asarray(cast(w, xs))
    np.testing.assert_allclose(got, np.asarray(by_hand(w, xs)), rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(np.asarray(jax.jit(cast)(w, xs)), got, rtol=1e-2, atol=1e-3)
    assert np.abs(got - np.asarray(fn(w, xs))).max() > 1e-4  # not the float32 function
    grad = jax.grad(lambda w: cast(w, xs).sum())(w)
    np.testing.assert_allclose(np.asarray(grad),
                               np.asarray(jax.grad(lambda w: fn(w, xs).sum())(w)),
                               rtol=0.1, atol=0.05)


def test_a_pytensor_scan_multiplies_in_bfloat16():
    """A Theano-style recurrence (pytensor.scan) compiled by precision.mode: its product
    inside the loop, and its gradient's, read bfloat16."""
    import pytensor
    import pytensor.tensor as pt
    w0, x0 = data((3, 3), (6, 3), seed=3)
    w = pytensor.shared(w0 / 2, name="w")
    xs = pt.tensor("xs", dtype="float32", shape=(6, 3))
    hs = pytensor.scan(lambda x, h: pt.tanh(pt.dot(h, w) + x), sequences=[xs],
                       outputs_info=[pt.zeros(3, dtype="float32")], return_updates=False)
    cost = hs[-1].sum()
    fn = pytensor.function([xs], [cost, pytensor.grad(cost, w)],
                           mode=precision.mode("bfloat16"))
    found = dtypes_of(fn.vm.jit_fn, x0, w0 / 2)
    assert len(found) >= 2 and set(found) == {("bfloat16", "bfloat16")}, found
    full = pytensor.function([xs], [cost, pytensor.grad(cost, w)], mode="JAX")
    for a, b in zip(fn(x0), full(x0)):
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.02)


def test_float32_is_the_function_itself_and_other_dtypes_are_left_alone():
    def fn(a, b):
        return a @ b

    assert precision.autocast(fn, "float32") is fn and precision.autocast(fn, None) is fn
    assert precision.mode("float32") == "JAX"
    i = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert dtypes_of(precision.autocast(fn, "bfloat16"), i, i.T) == [("int32", "int32")]
    np.testing.assert_array_equal(precision.autocast(fn, "bfloat16")(i, i.T), i @ i.T)
    with pytest.raises(ValueError, match="compute dtype must be one of"):
        precision.autocast(fn, "float16")
    with pytest.raises(ValueError, match="compute dtype must be one of"):
        precision.mode("int8")


def test_a_pytensor_step_compiled_in_bfloat16_convolves_and_multiplies_so():
    """A PyTensor function of pympgu.nnet's conv2d and a product, with its gradient's
    update, compiled by precision.mode: every convolution and product of the step (the
    forward pass's and the gradients') reads bfloat16; the update stays float32 and is
    the float32 function's to bfloat16's precision."""
    import pytensor
    import pytensor.tensor as pt

    from pympgu.nnet import conv2d
    x0, w0, v0 = data((4, 2, 6, 6), (3, 2, 3, 3), (27, 5), seed=1)
    x = pt.tensor("x", dtype="float32", shape=(4, 2, 6, 6))
    results = {}
    for dtype in ("float32", "bfloat16"):
        w, v = pytensor.shared(w0.copy(), name="w"), pytensor.shared(v0.copy(), name="v")
        h = pt.tanh(conv2d(x, w, padding=1, stride=2)).reshape((4, 27))
        cost = pt.sum(pt.dot(h, v) ** 2)
        gw, gv = pytensor.grad(cost, [w, v])
        fn = pytensor.function([x], cost, updates=[(w, w - np.float32(1e-3) * gw),
                                                   (v, v - np.float32(1e-3) * gv)],
                               mode=precision.mode(dtype))
        found = dtypes_of(fn.vm.jit_fn, x0, w0, v0)
        results[dtype] = (float(fn(x0)), w.get_value(), v.get_value(), found)
    *full, found32 = results["float32"]
    *low, found16 = results["bfloat16"]
    # The convolution, its filters' gradient, the product and its two gradients, at least
    # (conv2d's gradient is jax.vjp's: the convolution again and both its gradients, which
    # XLA drops where unused).
    assert len(found16) == len(found32) >= 5
    assert set(found16) == {("bfloat16", "bfloat16")}, found16
    assert set(found32) == {("float32", "float32")}, found32
    assert low[1].dtype == low[2].dtype == np.float32
    np.testing.assert_allclose(low[0], full[0], rtol=0.03)
    for a, b in zip(low[1:], full[1:]):
        np.testing.assert_allclose(a, b, rtol=0.03, atol=1e-3)
        assert not np.array_equal(a, b)


def test_two_cpu_workers_learn_in_bfloat16_and_end_identical(tmp_path):
    """The MLP on 2 CPU workers by JAX's backend: bfloat16 products learn as float32 ones
    do on the same data and seed, within a point, and run() checks the replicas agree."""
    base = RunConfig(backend="jax", epochs=2, hidden=[64], devices=[None, None])
    out = str(tmp_path / "run")
    low = train(base.replace(compute_dtype="bfloat16", out=out), quiet=True)
    full = train(base, quiet=True)
    assert low[-1]["test_error"] < 0.15, low
    assert abs(low[-1]["test_error"] - full[-1]["test_error"]) <= 0.01, (low, full)
    assert low[-1]["loss"] != full[-1]["loss"]  # the bfloat16 products ran
    # pympgu.evaluate evaluates it as it trained, products in bfloat16: the test error
    # training printed for its best epoch, to an example or two (XLA may leave a product's
    # result unrounded where it fuses it, differently in two programs: pympgu.precision);
    # PyTensor's own backend in float32.
    from pympgu import evaluate
    best = min(low, key=lambda h: h["valid_error"])
    run = evaluate.load(out)
    assert run.compute_dtype == "bfloat16"
    assert abs(run.evaluate("test")["error"] - best["test_error"]) <= 0.003
    assert evaluate.format_report(run, run.evaluate("test"))[0].endswith(
        "backend jax, bfloat16 products as trained")
    plain = evaluate.load(out, backend="c")
    assert plain.compute_dtype == "float32"
    assert "float32 products (trained with bfloat16's: --backend jax evaluates so)" in \
        evaluate.format_report(plain, plain.evaluate("test"))[0]
    assert abs(plain.evaluate("test")["error"] - best["test_error"]) <= 0.01


def test_compute_dtype_is_refused_on_pytensors_own_backend(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", "2", "--backend", "c", "--compute-dtype", "bfloat16"])
    assert info.value.code == 2
    assert "--compute-dtype bfloat16 needs --backend jax" in capsys.readouterr().err
