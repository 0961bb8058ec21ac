"""pympgu's rows of the training benchmark: a worker timing training steps as the training
loop runs them, the exchange's own costs, and the same step written in plain JAX."""
import functools
import statistics
import time

from ..exchange import ITEMSIZE
from ..precision import autocast
from .timing import time_device


def pympgu_worker(ctx, cfg, steps, warmup, plain_jax, inside=True):
    """One rank: time `steps` training steps with exchanges, as the training loop runs them
    (``cfg``, a RunConfig; ``inside``: the exchange inside the step's XLA call, else queued
    from Python after it)."""
    import numpy as np

    from ..schedule import Schedule
    from ..training import Steps
    from .clocks import Clocks
    steps_ = Steps(ctx, cfg, inside)
    rep, ex, step_exchange, sync = steps_.rep, steps_.ex, steps_.step_exchange, steps_.sync
    try:
        ntrain = len(rep.dataset.train[1])
        rng = np.random.default_rng(ctx.rank)
        batches = rep.device_batches([rng.integers(0, ntrain, cfg.batch_size).astype(np.int32)
                                      for _ in range(warmup + steps)])
        # The rate set before every step as the training loop sets it (Replica.apply_rate).
        schedule = Schedule(cfg.lr, warmup + steps, cfg.schedule)
        if inside and ex is not None and not ctx.is_cpu and not sync.fused \
                and not ex.way.peer_copies:
            # A variant meant to run inside XLA (VARIANTS: float32) that cannot: say so,
            # rather than time the Python-queued exchange under its name.
            raise RuntimeError("the exchange cannot run inside XLA: "
                               f"{step_exchange.unavailable()}")
        for i, idx in enumerate(batches[:warmup]):
            steps_.step(idx, schedule, i, i, last=i == warmup - 1)
        steps_.finish()
        if ctx.nranks > 1:
            ctx.barrier()
        sync.seconds = loop_s = 0.0
        with Clocks(ctx.device if not ctx.is_cpu else None) as clocks:
            t0 = time.perf_counter()
            for i, idx in enumerate(batches[warmup:]):
                t1 = time.perf_counter()
                steps_.step(idx, schedule, warmup + i, i, last=i == steps - 1)
                loop_s += time.perf_counter() - t1
            steps_.finish()
            wall = time.perf_counter() - t0
        # Host time per step: in the training call (with a fused exchange, that too), and in
        # exchanges queued on their own.
        out = {"samples_per_s": ctx.nranks * cfg.batch_size * steps / wall,
               "ms_per_step": 1e3 * wall / steps, "fused": sync.fused,
               "sync_host_ms_per_step": 1e3 * sync.seconds / steps,
               "step_host_ms_per_step": 1e3 * (loop_s - sync.seconds) / steps,
               "sm_mhz": clocks.mhz, "clock_capped": clocks.capped}
        if ex is not None:
            # Elements a regular exchange moves: half the state (the parameters or the
            # momentum) or all of it.
            moved = ex.part(*rep.part(sync.regular))
            out["wire_bytes"] = moved * ITEMSIZE[ex.wire_dtype or ex.dtype]
            out["exchanges"] = ex.stats["exchanges"]
            out["road"] = step_exchange.road if step_exchange is not None else None
            if not ctx.is_cpu:
                out["bare_kernel_ms"] = _bare_kernel_ms(ex, moved)
        if plain_jax:
            out["pytensor_ms"], out["direct_ms"], out["plain_jax_ms"] = _time_rounds(
                [(rep.train_fn, rep.wait), (rep.step, rep.wait), _plain_jax_step(rep, cfg)],
                batches)
            if not ctx.is_cpu and ctx.nranks == 1:
                out["r1"] = _exchange_overhead(ctx, rep, cfg)
        return out
    finally:
        steps_.close()


def _bare_kernel_ms(ex, n=None):
    """Device time of the exchange kernel alone on the first n elements of the exchanger's
    buffer (default: all), in its wire dtype. Every rank runs it together: each call crosses
    the GPU barrier."""
    g = ex.backend.group
    dtype = ex.wire_dtype or ex.dtype
    n = ex.total if n is None else n
    if ex.way.peer_copies:
        def run():
            g.copy_average(n, dtype, synchronize=False)
    else:
        def run():
            g.allreduce(n, dtype, algo=ex.method, synchronize=False,
                        max_blocks=ex.max_blocks)
    for _ in range(3):
        run()
    g.synchronize()
    return time_device(run, g.stream, 20) / 1e3


def _exchange_overhead(ctx, rep, cfg, calls=20):
    """One whole exchange of the replica's state with R = 1 (pack, kernel, unpack and the
    JAX copy-back: every pass but the link's), from an idle GPU until its result is ready,
    beside the kernel alone on the same bytes. On one GPU this isolates what the Exchanger
    adds around the kernel. The parts are host times: queueing the pack (with the arrays'
    DLPack exports), the average, and the unpack; the JAX import and split queue after."""
    from ..exchange import Exchanger
    with Exchanger(ctx, rep.layout, method=cfg.method) as ex:
        rep.exchange(ex)
        rep.wait()
        before = dict(ex.stats)
        samples, queued = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            rep.exchange(ex)
            t1 = time.perf_counter()
            rep.wait()
            samples.append(1e3 * (time.perf_counter() - t0))
            queued.append(1e3 * (t1 - t0))
        per = {k: 1e3 * (ex.stats[k] - before[k]) / calls for k in ("pack_s", "average_s",
                                                                     "unpack_s")}
        return {"exchange_ms": statistics.median(samples), "kernel_ms": _bare_kernel_ms(ex),
                "bytes": ex.nbytes, "pack_ms": per["pack_s"], "average_ms": per["average_s"],
                "unpack_ms": per["unpack_s"], "queued_ms": statistics.median(queued),
                "copy_back_ms": statistics.median(queued) - sum(per.values())}


def _time_rounds(calls, batches, rounds=5):
    """The median ms per call of each ``(call, wait)`` in ``calls``, each called on every
    batch back to back, then waited for. After one call each (compilation), they are timed
    in rounds, each once a round, so that a drift of the GPU between them touches each
    alike: timed one after another, a drift reads as a difference between them."""
    for call, wait in calls:
        call(batches[0])
        wait()
    samples = [[] for _ in calls]
    for _ in range(rounds):
        for (call, wait), times in zip(calls, samples):
            wait()
            t0 = time.perf_counter()
            for idx in batches:
                call(idx)
            wait()
            times.append(1e3 * (time.perf_counter() - t0) / len(batches))
    return [statistics.median(times) for times in samples]


def _plain_jax_step(rep, cfg):
    """The same step written directly in JAX (grad of the same loss, one jitted function,
    the same optimizer at a fixed rate), as ``(call, wait)`` for _time_rounds."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    model = rep.model
    params = [jnp.asarray(np.asarray(p.get_value())) for p in model.params]
    adam = model.optimizer != "sgd"
    vel = [jnp.zeros_like(p) for p in params * (2 if adam else 1)]  # donated: distinct
    x_all, y_all = (jnp.asarray(np.asarray(v.get_value())) for v in model.data_vars[:2])
    lr, mu, l2 = np.float32(cfg.lr), np.float32(cfg.momentum), np.float32(cfg.l2)
    kept = np.float32(1) - lr * np.float32(cfg.weight_decay)  # AdamW's weights
    b2, eps, k = np.float32(model.beta2), np.float32(model.eps), len(params)
    clip = np.float32(model.clip_norm)
    ema = np.float32(model.ema)

    def loss(params, x, y):
        h = x
        for i in range(0, len(params) - 2, 2):
            h = jnp.tanh(h @ params[i] + params[i + 1])
        logits = h @ params[-2] + params[-1]
        nll = -jnp.mean(jnp.sum(y * jax.nn.log_softmax(logits, axis=1), axis=1))
        return nll + l2 * sum(jnp.sum(params[i] ** 2) for i in range(0, len(params), 2))

    def update(params, vel, x_all, y_all, idx):
        # Autocast around the gradient, not inside it: the backward pass's products are
        # then in the traced program too, and read bfloat16 as pympgu's do.
        cost, g = autocast(jax.value_and_grad(loss), cfg.compute_dtype)(
            params, x_all[idx], y_all[idx])
        if clip:  # as optax.clip_by_global_norm would, with torch's 1e-6
            norm = jnp.sqrt(sum(jnp.sum(gi * gi) for gi in g))
            g = [gi * jnp.minimum(np.float32(1), clip / (norm + np.float32(1e-6))) for gi in g]
        if adam:
            m = [mu * mi + (1 - mu) * gi for mi, gi in zip(vel[:k], g)]
            v = [b2 * si + (1 - b2) * gi * gi for si, gi in zip(vel[k:], g)]
            params = [p * kept if i % 2 == 0 and model.optimizer == "adamw" else p
                      for i, p in enumerate(params)]
            return ([p - lr * mi / (jnp.sqrt(vi) + eps) for p, mi, vi in zip(params, m, v)],
                    m + v, cost)
        vel = [mu * v - lr * gi for v, gi in zip(vel, g)]
        return [p + v for p, v in zip(params, vel)], vel, cost

    # The dataset is an argument, not a closed-over constant, and the state is donated, as
    # a JAX user would write it.
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, vel, x_all, y_all, idx):
        if not ema:
            return update(params, vel, x_all, y_all, idx)
        # --ema: the average after the optimizer's state, moved from the new parameters.
        held, average = vel[:len(vel) - k], vel[len(vel) - k:]
        params, held, cost = update(params, held, x_all, y_all, idx)
        return params, held + [ema * a + (1 - ema) * p for a, p in zip(average, params)], cost

    # Donated arrays must be distinct: the average starts as a copy of the parameters.
    state = [params, vel + ([jnp.array(p, copy=True) for p in params] if ema else [])]

    def call(idx):
        state[0], state[1], _ = step(state[0], state[1], x_all, y_all, jnp.asarray(idx))

    return call, lambda: jax.block_until_ready(state)
