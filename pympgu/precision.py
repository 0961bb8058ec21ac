"""Mixed precision for PyTensor's JAX backend: matrix products and convolutions in bfloat16.

PyTensor has no bfloat16 type, so a model cannot be written in it, and on an H100 or H200
float32 matrix products run in TF32 at half bfloat16's tensor-core rate. ``--compute-dtype
bfloat16`` (pympgu.train) keeps the model, its parameters, the optimizer's state, the
update and the exchange in float32 and changes only how the compiled program multiplies:
every float32 ``dot_general`` and ``conv_general_dilated`` in it, the forward pass's and the
gradients' alike, reads its operands rounded to bfloat16, accumulates in float32 (cuBLAS and
cuDNN do for bfloat16) and rounds its result to bfloat16, which the float32 work after it
reads widened. That is what PyTorch's ``torch.autocast(dtype=torch.bfloat16)`` does to
matrix products and convolutions, and bfloat16 keeps float32's exponent range, so no loss
scaling is needed. Rounding the results matters for speed where the step moves more bytes
than it multiplies (a convnet's narrow layers): the products write half the bytes, and the
elementwise work after them reads half. XLA may leave a result unrounded where it fuses
the product with the work after it (its ``xla_allow_excess_precision`` rule, on by
default), so two programs of one model, the step's evaluation and pympgu.evaluate's, can
differ by that rounding: an example or two in a thousand, on the CPU. ``XLA_FLAGS=
--xla_allow_excess_precision=false`` rounds every result. On CPUs, whose XLA widens
bfloat16 products and convolutions to float32 to compute them, the same rule may drop the
operands' rounding too: LeNet's step on CPU workers trained to the same loss as in
float32, to four digits (and not with the rule off). CPU runs check the mechanism;
bfloat16's numbers and speed are the GPU's.

The change is made on the traced program (a jaxpr), not on PyTensor's graph: ``autocast``
traces a function, rewrites those two primitives, and evaluates the rest unchanged, looking
inside the jitted functions and custom derivatives a program calls (jax.numpy's functions
are jitted), and rewriting the programs of its loops and conditionals (``scan``, which a
``pytensor.scan`` recurrence becomes, ``while``, ``cond``). ``mode(dtype)`` is a PyTensor
mode whose compiled functions are so rewritten: the training step, the batch norms'
statistics and the evaluation alike.
"""
import numpy as np

from .xla.split import _read, bind

DTYPES = ("float32", "bfloat16")

# Primitives that call a program of their own on their operands and return its results:
# evaluated equation by equation, so that the products inside are rewritten too.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr"}
_PRODUCTS = ("dot_general", "conv_general_dilated")


def _low(dtype):
    """Whether ``dtype`` asks for a rewrite: False for float32 (or None), True for another
    of DTYPES; ValueError for anything else."""
    if dtype in (None, "float32"):
        return False
    if dtype not in DTYPES:
        raise ValueError(f"compute dtype must be one of {DTYPES}, got {dtype!r}")
    return True


def autocast(fn, dtype, static_argnums=()):
    """``fn`` with its float32 matrix products and convolutions computed in ``dtype``, their
    results widened back to float32 (see the module); ``fn`` itself when ``dtype`` is
    float32. ``static_argnums`` as jax.jit's: arguments that are Python values to trace
    with, not arrays. Custom derivatives are evaluated as the functions they belong to:
    put autocast around jax.grad, not inside it, so that the backward pass's products are
    in the traced program too, rewritten, and a custom rule is kept."""
    if not _low(dtype):
        return fn
    import functools

    import jax
    low = jax.numpy.dtype(dtype)

    @functools.wraps(fn)
    def cast(*args):
        closed, shapes = jax.make_jaxpr(fn, static_argnums=static_argnums,
                                        return_shape=True)(*args)
        dynamic = [a for k, a in enumerate(args) if k not in static_argnums]
        outs = _run(closed.jaxpr, closed.consts, jax.tree.leaves(dynamic), low)
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)

    return cast


def _run(jaxpr, consts, args, low):
    """The outputs of ``jaxpr`` on ``args``, its float32 products computed in ``low``."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        values = [_read(env, v) for v in eqn.invars]
        name = eqn.primitive.name
        inner = eqn.params.get(_CALLS.get(name, ""))
        if inner is not None:
            body, body_consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") \
                else (inner, ())
            outs = _run(body, body_consts, values, low)
        elif programs := {k: p for k, p in eqn.params.items() if _programs(p)}:
            # A loop or a conditional: its programs rewritten, its operands as they were.
            outs = bind(eqn, values, **{k: _rewritten(p, low) for k, p in programs.items()})
        elif name in _PRODUCTS and all(np.dtype(v.aval.dtype) == np.float32
                                       for v in eqn.invars):
            # The result rounded as well, then widened for the float32 work after it: XLA
            # fuses the widening into that work, so the product writes, and that work
            # reads, half the bytes (docs/DECISIONS.md, "Mixed precision").
            outs = [o.astype(np.float32) for o in bind(
                eqn, [x.astype(low) for x in values], preferred_element_type=low)]
        else:
            outs = bind(eqn, values)
        env.update(zip(eqn.outvars, outs))
    return [_read(env, v) for v in jaxpr.outvars]


def _programs(param):
    """The programs (ClosedJaxprs) that an equation's parameter holds: itself, or those of
    a tuple (``cond``'s branches)."""
    items = param if isinstance(param, tuple) else (param,)
    return [p for p in items if hasattr(p, "jaxpr") and hasattr(p, "consts")]


def _rewritten(param, low):
    """``param``, a program or a tuple of them, with each program's products in ``low``:
    the same operands and results, so the equation binds as before."""
    import jax

    def one(closed):
        specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
        return jax.make_jaxpr(lambda *a: _run(closed.jaxpr, closed.consts, a, low))(*specs)
    if isinstance(param, tuple):
        return tuple(one(p) if _programs(p) else p for p in param)
    return one(param)


def mode(dtype, backend="jax"):
    """The PyTensor mode to compile a model's functions with: for PyTensor's own backend
    ('c') its FAST_RUN, in float32 whatever ``dtype`` says (it has no bfloat16 products);
    for JAX's, 'JAX' itself for float32, else JAX's mode with its programs autocast to
    ``dtype``."""
    if backend != "jax":
        return "FAST_RUN"
    if not _low(dtype):
        return "JAX"
    from pytensor.compile.mode import Mode, get_mode
    from pytensor.link.jax.linker import JAXLinker

    class AutocastLinker(JAXLinker):
        def jit_compile(self, fn):
            return super().jit_compile(autocast(fn, dtype, self.scalar_shape_inputs))

    return Mode(linker=AutocastLinker(), optimizer=get_mode("JAX").provided_optimizer)
