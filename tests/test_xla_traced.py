"""pympgu.xla's operations as JAX traces them, on the CPU: where the waits fall in a step,
what crosses and in which dtype, and the values computed with the GPU calls stood in for."""
import pytest

import pympgu
from standin import StandInGroup, attributes

pytestmark = pytest.mark.skipif(pympgu.cuda_available(), reason="a GPU is usable here")


def _correction_case(monkeypatch, pympgu_env):
    """correct_during's case: 4 ranks (PYMPGU_SPLIT_MAX_RANKS=4 lets 'auto' gather), a
    tanh layer's SGD step, its arrays and a shared shadow."""
    import jax.numpy as jnp
    import numpy as np

    from pympgu.xla import ops

    class Group(StandInGroup):
        nbytes, nranks, rank, shadow_offset = 1 << 12, 4, 1, 1 << 12

    def fn(w, b, x):
        h = jnp.tanh(x @ w + b)
        gw, gb = x.T @ h, jnp.sum(h, axis=0)
        return [w - np.float32(0.1) * gw, b * np.float32(0.9) - np.float32(0.1) * gb], h.sum()

    def momentum(w, v, x):  # the momentum alone (--overlap --sync-every K)
        v_new = np.float32(0.9) * v - np.float32(0.1) * (x.T @ jnp.tanh(x @ w))
        return [v_new, w + v_new], None

    monkeypatch.setattr(ops, "register", lambda: None)
    pympgu_env(split_max_ranks=4)
    rng = np.random.default_rng(0)
    w, b, x = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (8,), (4, 16)))
    shadow = rng.standard_normal(3 * Group.nbytes // 4).astype(np.float32)
    return Group, fn, momentum, (w, b, x, shadow), rng


def test_xla_correction_waits_inside_the_update(monkeypatch, pympgu_env):
    # Given the shared shadow as an input, correct_during cuts fn before its elementwise
    # tail (the update): the wait comes after every matrix product and takes the gradients,
    # the tail reads the shadow after it, and there is no done operation.
    jax = pytest.importorskip("jax")
    from pympgu import xla
    from pympgu.xla import ops
    Group, fn, _, (w, b, x, shadow), _ = _correction_case(monkeypatch, pympgu_env)
    jaxpr = jax.make_jaxpr(lambda w, b, x, shadow: xla.correct_during(
        [w, b], Group(), fn, w, b, x, shadow=shadow))(w, b, x, shadow)
    assert not jaxpr.effects
    eqns = jaxpr.jaxpr.eqns
    names = [e.primitive.name for e in eqns]
    calls = [k for k, n in enumerate(names) if n == "ffi_call"]
    assert len(calls) == 2, names
    start, wait = (eqns[k] for k in calls)
    assert start.params["target_name"] == ops.START
    assert wait.params["target_name"] == ops.WAIT
    dots = [k for k, n in enumerate(names) if n == "dot_general"]
    assert calls[0] < dots[0] and calls[1] > dots[-1], names
    # Behind the start's token: x, which fn's work needs first, but not the averaged w and
    # b (out of a barrier, XLA's GPU compiler no longer fused a bias into cuBLAS's product).
    first = eqns[calls[0] + 1]
    assert first.primitive.name == "optimization_barrier", names
    w_in, b_in, x_in, _ = jaxpr.jaxpr.invars
    assert x_in in first.invars and not {w_in, b_in} & set(first.invars), first
    # The gradients are the wait's operands; the tail's reads of the shadow come after it.
    gradients = {eqns[k].outvars[0] for k in dots[1:]}
    assert gradients <= set(wait.invars), names
    # It passes the smallest gradient (b's) through, held with the shadow for the tail.
    (operand, result), = wait.params["input_output_aliases"]
    assert result == 0 and wait.invars[operand].aval.shape == (8,), wait
    held = eqns[calls[1] + 1]
    assert held.primitive.name == "optimization_barrier" and wait.outvars[0] in held.invars
    assert not [n for n in names[calls[1]:] if n in ("dot_general", "tanh", "reduce_sum")]


def test_xla_correction_of_an_update_with_no_work_before_or_of_the_momentum(
        monkeypatch, pympgu_env):
    # An update with no work before it leaves no place for the wait: pympgu's pass corrects.
    # The momentum alone (--overlap --sync-every K): the parameters' update reads its new
    # value, yet it is still corrected inside the update (a wait, no done), since fn
    # returns the parameters' new value after it.
    jax = pytest.importorskip("jax")
    from pympgu import xla
    from pympgu.xla import ops
    Group, _, momentum, (w, b, x, shadow), _ = _correction_case(monkeypatch, pympgu_env)
    jaxpr = jax.make_jaxpr(lambda w, b, s: xla.correct_during(
        [w, b], Group(), lambda w, b: ([w + 1, b + 1], None), w, b, shadow=s))(w, b, shadow)
    targets = [e.params["target_name"] for e in jaxpr.jaxpr.eqns
               if e.primitive.name == "ffi_call"]
    assert targets == [ops.START, ops.DONE], targets
    for ready in (True, False):
        jaxpr = jax.make_jaxpr(lambda w, v, x, s: xla.correct_during(
            [v], Group(), momentum, w, v, x, shadow=s, ready=[w] if ready else []))(
                w, w + 1, x, shadow)
        eqns = jaxpr.jaxpr.eqns
        targets = [e.params["target_name"] for e in eqns if e.primitive.name == "ffi_call"]
        assert targets == [ops.START, ops.WAIT], targets
        # Behind the start's token: x; the parameters w too unless they are ready.
        held = next(e for e in eqns if e.primitive.name == "optimization_barrier")
        w_in, _, x_in, _ = jaxpr.jaxpr.invars
        assert x_in in held.invars and (w_in in held.invars) != ready, (ready, held)


def test_xla_correction_computes_fresh_plus_mean_minus_own(monkeypatch, pympgu_env):
    # Run on the CPU with the start and the wait stood in for, each result is fresh + (mean
    # - own), the mean summed in rank order from this rank's value and the shadow's slots.
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from pympgu import xla
    from pympgu.xla import ops
    Group, fn, momentum, (w, b, x, shadow), rng = _correction_case(monkeypatch, pympgu_env)
    monkeypatch.setattr(ops, "start", lambda *a, **k: jnp.uint32(0))
    monkeypatch.setattr(ops, "wait", lambda token, after, attrs, k: after[k])
    got, loss = jax.jit(lambda w, b, x, s: xla.correct_during(
        [w, b], Group(), fn, w, b, x, shadow=s))(w, b, x, shadow)
    (fw, fb), want_loss = fn(w, b, x)
    attrs, _ = ops.attributes([w, b], Group(), "auto", None, overlapped=True)
    slot = ops.slot_elems(Group(), int(attrs["total"]))
    for g, fresh, own, at in zip(got, (fw, fb), (w, b), attrs["offsets"]):
        peer0, peer2, peer3 = (shadow[s * slot + at:s * slot + at + own.size].reshape(
            own.shape) for s in (0, 1, 2))
        mean = (((peer0 + own) + peer2) + peer3) / np.float32(4)
        np.testing.assert_allclose(np.asarray(g), np.asarray(fresh) + (mean - own),
                                   rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    v = rng.standard_normal(w.shape).astype(np.float32)
    (got,), _ = jax.jit(lambda w, v, x, s: xla.correct_during(
        [v], Group(), momentum, w, v, x, shadow=s, ready=[w]))(w, v, x, shadow)
    slot = ops.slot_elems(Group(), v.size)  # the slots of an exchange of v alone
    peers = [shadow[s * slot:s * slot + v.size].reshape(v.shape) for s in (0, 1, 2)]
    mean = (((peers[0] + v) + peers[1]) + peers[2]) / np.float32(4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(momentum(w, v, x)[0][0]) + (mean - v),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="shadow= needs the gather algorithm"):
        xla.correct_during([w, b], Group(), fn, w, b, x, shadow=shadow, algo="oneshot")
    # XLA's division by 3 ranks rounds otherwise than the kernels': no shadow for them.
    Group.nranks = 3
    with pytest.raises(ValueError, match="a power of two ranks"):
        xla.correct_during([w, b], Group(), fn, w, b, x, shadow=shadow)
    assert xla.shadow_array(Group()) is None


def test_overlapped_exchange_gathers_only_up_to_split_max_ranks(monkeypatch, pympgu_env):
    # 'gather' copies every rank's state to every peer, R - 1 copies a rank: on 4 H200s a
    # kernel beside the step took less of it. Above PYMPGU_SPLIT_MAX_RANKS the overlapped
    # exchange takes the group's own algorithm at the Exchanger's grid cap, and a shadow
    # for the fused correction is refused (shadow_array gives none there).
    pytest.importorskip("jax")
    import numpy as np

    from pympgu import xla
    from pympgu.xla import ops

    class Group(StandInGroup):
        nbytes, rank, shadow_offset, chosen = 1 << 12, 1, 1 << 12, "push"

        def shadow_view(self):
            raise AssertionError("shadow_array looked at a shadow it must not offer")

    monkeypatch.setattr(ops, "register", lambda: None)
    w = np.ones((16, 8), np.float32)
    chosen = {}
    for nranks, max_ranks in ((2, 2), (4, 2), (8, 4), (4, 4)):
        Group.nranks = nranks
        pympgu_env(split_max_ranks=max_ranks)
        attrs, chosen[nranks, max_ranks] = ops.attributes([w], Group(), "auto", 64,
                                                           overlapped=True)
        assert int(attrs["max_blocks"]) == 64
    assert chosen == {(2, 2): "gather", (4, 2): "push", (8, 4): "push", (4, 4): "gather"}
    for nranks in (4, 8):
        Group.nranks = nranks
        pympgu_env(split_max_ranks=2)
        assert xla.shadow_array(Group()) is None
        with pytest.raises(ValueError, match="shadow= needs the gather algorithm"):
            xla.correct_during([w], Group(), lambda v: ([v + 1], None), w, shadow=w.ravel())


def test_gradients_averaged_by_the_kernel_above_split_max_ranks(monkeypatch, pympgu_env):
    # Above PYMPGU_SPLIT_MAX_RANKS the gradients are averaged by the group's kernel in two
    # parts: the first part's (the gradients that need no late work) lie first in the
    # buffer, start between the phases at a grid capped at BESIDE_BLOCKS, and their done
    # follows the second start; the second part starts after the late work at the full
    # grid. Each algorithm is chosen for its part's bytes.
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from pympgu import settings, xla
    from pympgu.xla import ops
    from pympgu._cuda import ALGORITHM_CODES

    class Group(StandInGroup):
        nbytes, nranks, rank, max_blocks = 1 << 20, 4, 1, 264

        def algorithm(self, nbytes, algo):
            return "push" if nbytes > 2048 else "twoshot"

    mu, lr = np.float32(0.5), np.float32(0.25)

    def step(w1, w2, b2, v1, v2, u2, x, scale=1):
        g2 = scale * (x[:, :32].T @ x[:, 32:])  # these two need no late work
        gb2 = scale * jnp.sum(x[:, 32:], axis=0)
        late = jnp.tanh(x @ x.T @ x)  # what only w1's gradient needs
        g1 = scale * (late[:, :16].T @ late[:, 16:48])
        nv1, nv2, nu2 = mu * v1 - lr * g1, mu * v2 - lr * g2, mu * u2 - lr * gb2
        return [w1 + nv1, w2 + nv2, b2 + nu2, nv1, nv2, nu2, jnp.sum(late)]

    monkeypatch.setattr(ops, "register", lambda: None)
    pympgu_env(split_min_bytes=0)
    rng = np.random.default_rng(0)
    shapes = [(16, 32), (32, 32), (32,), (16, 32), (32, 32), (32,), (8, 64)]
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    updated, which, local = list(range(6)), [0, 1, 2], [6]
    group = Group()
    tail, why = xla.gradient_plan(step, updated, group, args, local)
    assert why is None and not xla.gradients_by_copies(group, None, "auto"), why

    def run(*a):
        return xla.average_gradients(step, updated, which, group, *a, local=local)

    eqns = jax.make_jaxpr(run)(*args).jaxpr.eqns
    calls = [e for e in eqns if e.primitive.name == "ffi_call"]
    assert [e.params["target_name"] for e in calls] == [
        ops.START, ops.START, ops.WAIT, ops.DONE, ops.WAIT, ops.DONE], calls
    first, last, _, done_first, _, done_last = (attributes(e) for e in calls)
    assert (first["phase"], last["phase"]) == (1, 2)
    # w2's and b2's gradients first, from offset 0; w1's (16 x 32) after them (the layout
    # starts each array on 256 bytes).
    assert sorted(first["offsets"]) == [0, 32 * 32] and list(last["offsets"]) == [34 * 32]
    assert first["max_blocks"] == settings.get().beside_blocks and last["max_blocks"] == 264
    assert first["algo"] == ALGORITHM_CODES["push"]
    assert last["algo"] == ALGORITHM_CODES["twoshot"]
    assert (done_first["part"], done_last["part"]) == (1, 2)
    assert sorted(done_first["offsets"]) == [0, 32 * 32]
    assert list(done_last["offsets"]) == [34 * 32]
    # The late work comes after the first start, and the first part's done after both.
    names = [e.primitive.name for e in eqns]
    start1 = eqns.index(calls[0])
    assert "tanh" in names[start1:] and "tanh" not in names[:start1], names
    # Given max_blocks, every part takes it.
    capped = jax.make_jaxpr(lambda *a: xla.average_gradients(
        step, updated, which, group, *a, local=local, max_blocks=16))(*args).jaxpr.eqns
    assert {int(attributes(e)["max_blocks"]) for e in capped if e.primitive.name == "ffi_call"
            and e.params["target_name"] == ops.START} == {16}

    # Run on the CPU with the start, the wait and the done stood in for: the update reads
    # the dones' results (here twice each rank's own gradient).
    monkeypatch.setattr(ops, "start", lambda *a, **k: jnp.uint32(0))
    monkeypatch.setattr(ops, "wait", lambda token, after, attrs, k, part: after[k])
    monkeypatch.setattr(ops, "done", lambda token, arrays, attrs, part, offsets:
                        [2 * a for a in arrays])
    got = jax.jit(lambda *a: run(*a))(*args)  # traced anew
    want = step(*args, scale=2)
    for g, w in zip(got[:6], want[:6]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(got[6]), float(want[6]), rtol=1e-5)


def test_xla_average_results_cuts_the_step(monkeypatch, pympgu_env):
    # Traced on the CPU: with a shared shadow, the results that need no late work start
    # first (phase 1), the matrix product they do not need comes after that start and its
    # barrier, and the result that needs it is sent by a second start. Two dones follow, the
    # first part's before the last part's. Without a shadow it is a plain average after the
    # function.
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from pympgu import xla
    from pympgu.xla import ops

    class Group(StandInGroup):
        shadow_offset = 1 << 20

    def fn(w, v):
        late = w @ w.T @ w  # what only the last result needs
        return [w * 2, v + 1, v + jnp.sum(late)]

    monkeypatch.setattr(ops, "register", lambda: None)
    pympgu_env(split_min_bytes=0)  # these arrays are small
    args = (jnp.ones((64, 64)), jnp.ones(64))
    jaxpr = jax.make_jaxpr(lambda w, v: xla.average_results(fn, [0, 2], Group(), w, v))(*args)
    assert not jaxpr.effects
    eqns = jaxpr.jaxpr.eqns
    names = [e.primitive.name for e in eqns]
    calls = [k for k, n in enumerate(names) if n == "ffi_call"]
    assert len(calls) == 4, names
    first, second, done_first, done_last = (attributes(eqns[c]) for c in calls)
    assert first["phase"] == 1 and second["phase"] == 2 and "phase" not in done_first, names
    assert done_first["part"] == 1 and done_last["part"] == 2, names
    assert calls[0] < names.index("dot_general") and calls[1] > max(
        k for k, n in enumerate(names) if n == "dot_general"), names
    assert names[calls[2] - 1] == "optimization_barrier", names
    # The last part's done waits, through a barrier, for the first part's results.
    between = eqns[calls[3] - 1]
    assert between.primitive.name == "optimization_barrier", names
    assert set(eqns[calls[2]].outvars) <= set(between.invars)
    assert eqns[calls[3]].invars[0] in between.outvars
    # The second part takes the first's token (held by the barrier before phase 2): XLA
    # would otherwise drop the first part, whose token nothing else uses.
    hold = eqns[names.index("optimization_barrier")]
    assert eqns[calls[0]].outvars[0] in hold.invars
    assert eqns[calls[1]].invars[0] in hold.outvars
    assert first["offsets"].tolist() == done_first["offsets"].tolist() == [0]  # w * 2 first
    assert second["offsets"].tolist() == done_last["offsets"].tolist() != [0]
    out = jax.eval_shape(lambda w, v: xla.average_results(fn, [0, 2], Group(), w, v), *args)
    assert [o.shape for o in out] == [(64, 64), (64,), (64,)]

    # Too small to cut, too many ranks, or no shared shadow: a plain average after it.
    for threshold, nranks, offset in ((64 * 65 * 4 + 1, 2, 1 << 20), (0, 3, 1 << 20),
                                      (0, 2, 0)):
        pympgu_env(split_min_bytes=threshold)
        Group.nranks, Group.shadow_offset = nranks, offset
        jaxpr = jax.make_jaxpr(lambda w, v: xla.average_results(fn, [0, 2], Group(), w, v))(
            *args)
        names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
        assert names.count("ffi_call") == 1 and "optimization_barrier" not in names, names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_correction_inside_adams_update(monkeypatch, dtype, pympgu_env):
    # --optimizer adam --overlap: the whole state (parameters and both moments) is averaged
    # while the step computes, and each result is corrected inside Adam's update, which
    # squares, roots and divides: the wait still comes after the matrix products, and on the
    # CPU, the start and the wait stood in for, every result is fresh + (mean - own). With
    # --compute-dtype bfloat16 the products' results are widened before the wait, which
    # takes float32 values.
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from pympgu import precision, xla
    from pympgu.xla import ops

    class Group(StandInGroup):
        nbytes, nranks, rank, shadow_offset = 1 << 14, 2, 1, 1 << 14

    b1, b2, eps, lr = np.float32(0.9), np.float32(0.999), np.float32(1e-8), np.float32(1e-3)

    def adam32(w, m, s, x):
        g = x.T @ jnp.tanh(x @ w)
        m_new = b1 * m + (np.float32(1) - b1) * g
        s_new = b2 * s + (np.float32(1) - b2) * (g * g)
        return [w - lr * m_new / (jnp.sqrt(s_new) + eps), m_new, s_new], None
    adam = precision.autocast(adam32, dtype)

    monkeypatch.setattr(ops, "register", lambda: None)
    rng = np.random.default_rng(1)
    w, m, x = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (16, 8), (4, 16)))
    s = np.abs(rng.standard_normal((16, 8))).astype(np.float32)
    shadow = np.abs(rng.standard_normal(Group.nbytes // 4)).astype(np.float32)

    def step(w, m, s, x, shadow):
        return xla.correct_during([w, m, s], Group(), adam, w, m, s, x, shadow=shadow)

    eqns = jax.make_jaxpr(step)(w, m, s, x, shadow).jaxpr.eqns
    names = [e.primitive.name for e in eqns]
    calls = [e.params["target_name"] for e in eqns if e.primitive.name == "ffi_call"]
    assert calls == [ops.START, ops.WAIT], calls
    wait = names.index("ffi_call", names.index("ffi_call") + 1)
    assert "dot_general" not in names[wait:] and "sqrt" in names[wait:], names
    assert {str(v.aval.dtype) for v in eqns[wait].invars} == {"uint32", "float32"}, eqns[wait]
    assert ("bfloat16" in {str(v.aval.dtype) for e in eqns for v in e.outvars}) == (
        dtype == "bfloat16")

    monkeypatch.setattr(ops, "start", lambda *a, **k: jnp.uint32(0))
    monkeypatch.setattr(ops, "wait", lambda token, after, attrs, k: after[k])
    got, _ = jax.jit(lambda *a: step(*a))(w, m, s, x, shadow)  # traced anew
    fresh, _ = adam(w, m, s, x)
    attrs, _ = ops.attributes([w, m, s], Group(), "auto", None, overlapped=True)
    # In bfloat16, to a few roundings of a product's result: XLA may leave one unrounded
    # where it fuses it (pympgu.precision), differently in the two programs, and Adam's
    # division carries the difference on. A correction left out would miss by (mean - own),
    # of the order of 1.
    rtol, atol = (1e-5, 1e-6) if dtype == "float32" else (0.02, 1e-3)
    for g, new, own, at in zip(got, fresh, (w, m, s), attrs["offsets"]):
        peer = shadow[at:at + own.size].reshape(own.shape)  # rank 0's slot
        mean = (peer + own) / np.float32(2)
        np.testing.assert_allclose(np.asarray(g), np.asarray(new) + (mean - own),
                                   rtol=rtol, atol=atol)


def _half_case(monkeypatch, wire):
    """A half-precision wire's case (DDP's bf16_compress_hook): 2 ranks, a momentum step,
    its arrays, a peer's rounded values in a shadow of the wire's dtype, and ``run``, the
    step with its gradients averaged."""
    import jax.numpy as jnp
    import numpy as np
    from reference import bf16_to_f32, f32_to_bf16

    from pympgu import xla
    from pympgu.xla import ops

    class Group(StandInGroup):
        nbytes, nranks, rank, shadow_offset = 1 << 12, 2, 1, 1 << 12

    mu, lr = np.float32(0.5), np.float32(0.1)

    def rounded(a):  # to nearest even in the wire's dtype, widened: numpy's, not XLA's
        a = np.asarray(a, np.float32)
        if wire == "bfloat16":
            return bf16_to_f32(f32_to_bf16(a.ravel())).reshape(a.shape)
        return a.astype(np.float16).astype(np.float32)

    def step(w, v, x):
        g = x.T @ jnp.tanh(x @ w)
        nv = mu * v - lr * g
        return [w + nv, nv, jnp.sum(g)]

    monkeypatch.setattr(ops, "register", lambda: None)
    rng = np.random.default_rng(0)
    w, v, x = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (16, 8), (4, 16)))
    peer = rounded(rng.standard_normal(Group.nbytes // 2))
    shadow = jnp.asarray(peer).astype(jnp.dtype(wire))  # exact: the values are the wire's
    group = Group()

    def run(w, v, x, shadow, wire=wire):
        return xla.average_gradients(step, [0, 1], [0, 1], group, w, v, x, shadow=shadow,
                                     local=[2], wire=wire)
    return Group, group, step, rounded, (mu, lr), (w, v, x, peer, shadow), run


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_gradients_cross_in_half_precision(monkeypatch, wire):
    # The gradients are rounded before they cross, and the start and the wait take the
    # wire's dtype, at any size.
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from pympgu import xla
    from pympgu.xla import ops
    Group, group, step, _, _, (w, v, x, _, shadow), run = _half_case(monkeypatch, wire)
    # Far under PYMPGU_SPLIT_MIN_BYTES: the float32 gradients would not cross, the wire's do
    # (inside XLA it has no other road).
    assert "under PYMPGU_SPLIT_MIN_BYTES" in xla.gradient_plan(step, [0, 1], group,
                                                               [w, v, x], [2], shadow)[1]
    assert xla.gradient_plan(step, [0, 1], group, [w, v, x], [2], shadow,
                             wire=wire)[1] is None
    eqns = jax.make_jaxpr(run)(w, v, x, shadow).jaxpr.eqns
    calls = [e for e in eqns if e.primitive.name == "ffi_call"]
    assert [e.params["target_name"] for e in calls] == [ops.START, ops.WAIT], calls
    start, wait = calls
    assert [a.aval.dtype for a in start.invars] == [jnp.dtype(wire)], start
    assert attributes(start)["algo"] == ops.gather_code()
    with pytest.raises(ValueError, match=f"the shadow is float32, the wire {wire}"):
        run(w, v, x, jnp.zeros(Group.nbytes // 4, np.float32))
    with pytest.raises(ValueError, match="wire must be"):
        run(w, v, x, shadow, wire="int8")


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_gradients_in_half_precision_sum_in_float32(monkeypatch, wire):
    # The update sums this rank's rounded gradient and the peer's from a shadow of the
    # wire's dtype in float32. Above PYMPGU_SPLIT_MAX_RANKS the kernel averages the wire's
    # dtype and the update reads its means widened. Run on the CPU with the start, the wait
    # and the done stood in for.
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from pympgu import xla
    from pympgu.xla import ops
    Group, group, _, rounded, (mu, lr), (w, v, x, peer, shadow), run = _half_case(
        monkeypatch, wire)
    monkeypatch.setattr(ops, "start", lambda *a, **k: jnp.uint32(0))
    monkeypatch.setattr(ops, "wait", lambda token, after, attrs, k, part=0: after[k])
    got_w, got_v = jax.jit(lambda *a: run(*a))(w, v, x, shadow)[:2]
    # XLA's own gradient: its tanh is not numpy's, and a last-bit difference can round
    # to another value of the wire's dtype.
    own = rounded(jax.jit(lambda w, x: x.T @ jnp.tanh(x @ w))(w, x))
    theirs = peer[:own.size].reshape(own.shape)  # rank 0's slot, at offset 0
    want_v = mu * v - lr * ((theirs + own) / np.float32(2))  # rank order: 0, then 1
    np.testing.assert_allclose(np.asarray(got_v), want_v, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_w), w + want_v, rtol=1e-6, atol=1e-6)

    # Three ranks: the kernel averages the wire's dtype; the update reads the means widened.
    Group.nranks = 3
    low = jnp.dtype(wire)

    def done(token, arrays, attrs, part, offsets):
        assert all(a.dtype == low for a in arrays), arrays
        return [a + a for a in arrays]

    monkeypatch.setattr(ops, "done", done)
    assert not xla.gradients_by_copies(group, shadow, "auto")
    got_w, got_v = jax.jit(lambda *a: run(*a, None))(w, v, x)[:2]
    np.testing.assert_allclose(np.asarray(got_v), mu * v - lr * (2 * own), rtol=1e-6, atol=1e-6)
