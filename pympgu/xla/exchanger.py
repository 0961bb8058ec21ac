"""An Exchanger's exchanges inside a jitted training step: its group, method, grid cap and
wire applied to the operations of pympgu.xla."""
from .. import methods
from . import ops
from .gradients import average_gradients, gradient_plan, gradients_by_copies
from .overlap import average_during, correct_during, shadow_array
from .results import average_results


class StepExchange:
    """The exchanges of ``exchanger`` (a pympgu.exchange.Exchanger) as XLA operations.

    They average the same bytes with the same kernels as the Exchanger's own start() and
    finish(), so ranks may mix the two from one exchange to the next, but every rank must
    take the same road in the same exchange. Arrays are the layout's first entries, in its
    order (every rank the same count). Exchanges made this way are not counted in the
    Exchanger's ``stats``. ``road`` says, in words, what average_gradients last traced.
    """

    def __init__(self, exchanger):
        self.ex = exchanger
        self.road = None

    def unavailable(self, gradients=False) -> str | None:
        """None when the exchanger's exchanges can run inside XLA here, else why not;
        ``gradients``: for average_gradients, the one XLA road a low-precision wire takes
        (its gradients cross rounded, and need no reference)."""
        ex = self.ex
        if ex.ctx.is_cpu:
            return "CPU workers exchange through shared memory"
        if ex.wire_dtype and not gradients:
            return (f"the {ex.wire_dtype} wire keeps state outside XLA (inside it, only "
                    "--sync-every 1's gradients cross in it)")
        if ex.backend.across is None and (ex.way.peer_copies or not ex.backend.peer_ok):
            return "the copy method with host barriers runs outside XLA"
        return ops.available()[1]

    @property
    def algo(self) -> str:
        """The operations' algorithm: the exchanger's method, except where NCCL takes part
        (across nodes, or the 'nccl' method), whose group takes NCCL's road whatever kernel
        algorithm is named (PeerGroup.join_nodes): one that needs no shadow."""
        return methods.ACROSS_NODES if self.ex.backend.across is not None else self.ex.method

    def average(self, arrays) -> list:
        """The averages of ``arrays`` as JAX arrays, for use inside a jitted function
        (pympgu.xla.average)."""
        return ops.average(arrays, self._group(arrays), algo=self.algo,
                           max_blocks=self.ex.max_blocks)

    def average_results(self, fn, which, *args) -> list:
        """``fn(*args)`` (a flat list of arrays) with its results at positions ``which``
        averaged, each sent as soon as it is computed (pympgu.xla.average_results)."""
        import jax
        shapes = jax.eval_shape(lambda *a: list(fn(*a)), *args)
        group = self._group([shapes[i] for i in which])
        return average_results(fn, which, group, *args, algo=self.algo,
                               max_blocks=self.ex.max_blocks)

    def average_gradients(self, fn, updated, which, *args, shadow=None, local=(), exact=True,
                          alike=False) -> list:
        """pympgu.xla.average_gradients over the exchanger's group: ``fn``'s results at
        ``updated`` computed from every rank's mean gradient, or, where that does not apply,
        its results at ``which`` averaged. ``shadow`` is ``shadow(correction=False)``'s
        array, or None; ``exact`` and ``alike`` as average_gradients takes them. A
        low-precision wire is the gradients'; where they do not cross, the results are
        averaged in float32. ``road`` then says which was traced."""
        import jax
        ex = self.ex
        shapes = jax.eval_shape(lambda *a: list(fn(*a)), *args)
        group = self._group([shapes[i] for i in which], gradients=True)
        plan = gradient_plan(fn, updated, group, args, local, shadow, self.algo, exact,
                             ex.wire_dtype, alike)
        wire = f", sent in {ex.wire_dtype}" if ex.wire_dtype else ""
        if plan[1] is not None:
            self.road = ("the new values averaged after the update"
                         f"{', in float32' if wire else ''}: {plan[1]}")
        elif gradients_by_copies(group, shadow, self.algo):
            self.road = f"the update of the mean gradients{wire}"
        else:
            self.road = (f"the update of the mean gradients{wire}, averaged by the kernel "
                         f"({group.nranks} ranks)")
        return average_gradients(fn, updated, which, group, *args, shadow=shadow, local=local,
                                 algo=self.algo, max_blocks=ex.max_blocks, plan=plan,
                                 exact=exact, wire=ex.wire_dtype, alike=alike)

    def average_during(self, arrays, fn, *args) -> tuple:
        """``average(arrays)`` taken while ``fn(*args)`` computes; returns both
        (pympgu.xla.average_during)."""
        return average_during(arrays, self._group(arrays), fn, *args, algo=self.algo,
                              max_blocks=self.ex.max_blocks)

    def correct_during(self, arrays, fn, *args, shadow=None, ready=()) -> tuple:
        """pympgu.xla.correct_during over the exchanger's group; ``shadow`` is
        ``shadow()``'s array, or None."""
        return correct_during(arrays, self._group(arrays), fn, *args, algo=self.algo,
                              max_blocks=self.ex.max_blocks, shadow=shadow, ready=ready)

    def shadow(self, correction=True) -> object:
        """The shared shadow as a JAX array, for correct_during's ``shadow`` (or with
        ``correction=False``, average_gradients'), or None where it cannot serve: no
        shared shadow (the Exchanger's ``shadow``), a number of ranks that is not a power of
        two or is above PYMPGU_SPLIT_MAX_RANKS (pympgu.xla.shadow_array), a method other
        than 'auto', or other arrays than float32. For the gradients it is of the wire's
        dtype."""
        ex = self.ex
        if (not ex.way.shadow or self.unavailable(gradients=not correction)
                or any(d != "float32" for _, _, d in ex.layout)):
            return None
        wire = "float32" if correction else ex.wire_dtype or "float32"
        return shadow_array(ex.backend.group, wire)

    def _group(self, arrays, gradients=False):
        """The PeerGroup for an XLA exchange of ``arrays``, after checking both
        (``gradients``: for average_gradients)."""
        ex = self.ex
        why = self.unavailable(gradients)
        if why:
            raise RuntimeError(f"rank {ex.ctx.rank}: cannot average inside XLA: {why}")
        shapes = [tuple(a.shape) for a in arrays]
        if not shapes or shapes != [tuple(shape) for _, shape, _ in ex.layout[:len(shapes)]]:
            raise ValueError(f"the exchange inside XLA got shapes {shapes} for the layout "
                             f"{[(n, tuple(s)) for n, s, _ in ex.layout]}")
        return ex.backend.group
