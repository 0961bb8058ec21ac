"""Cut a JAX program in two where some of its results are ready (pympgu.xla.average_results).

A training step computes its last layer's gradient first and its first layer's last. The
averages of the parameters whose new values are ready early can cross the link while the
step computes the rest, as PyTorch DDP's gradient buckets do. XLA schedules a jitted
program as it likes, so the cut is made by hand: the program is traced to a jaxpr, and its
equations are split into

- phase 1: every equation that the chosen early results need;
- phase 2: everything else, whose inputs are then held behind an optimization barrier with
  the exchange's token, so that XLA can start none of it before the exchange has started.

Which results are early is chosen from the matrix products' FLOPs. The early set grows one
result at a time, each time by the one that adds the least work to phase 1, and the set
kept is the one that maximizes (bytes sent early) x (FLOPs left in phase 2 to hide them
behind): a result sent early but with no work left to hide behind gains nothing. A program
without matrix products is not cut.

``Tail`` cuts a program another way, before the elementwise update at its end, so that
pympgu.xla.correct_during can fuse the overlapped step's correction into that update, and
pympgu.xla.average_gradients can feed that update the ranks' mean gradients.
"""
import math

import numpy as np


def _flops(eqn):
    """Floating-point operations of one equation: its matrix products and convolutions (the
    elementwise rest is small beside them), and those of any program it calls."""
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs) // max(out_features, 1)
    total = 0
    for param in eqn.params.values():
        inner = getattr(param, "jaxpr", param)  # a ClosedJaxpr, or a Jaxpr
        if hasattr(inner, "eqns"):
            total += sum(_flops(e) for e in inner.eqns)
    return total


def _nbytes(var):
    return math.prod(var.aval.shape) * np.dtype(var.aval.dtype).itemsize


def _is_var(v):
    return not hasattr(v, "val")  # a Literal carries its value


class Split:
    """A traced program, cut for the results at positions ``which`` (see the module).

    ``early`` and ``late`` partition ``which``, in its order; ``late`` may be empty, and
    ``early`` is empty when nothing is worth cutting. ``flops`` is the work of each phase.
    """

    def __init__(self, closed, which):
        jaxpr, consts = _unwrap(closed)
        self.jaxpr, self.consts, self.which = jaxpr, consts, list(which)
        eqns = jaxpr.eqns
        producer = {}
        for k, eqn in enumerate(eqns):
            for v in eqn.outvars:
                producer[v] = k
        cost = [_flops(e) for e in eqns]
        total = sum(cost)

        def cone(vars_):
            seen, todo = set(), [v for v in vars_ if _is_var(v) and v in producer]
            while todo:
                k = producer[todo.pop()]
                if k not in seen:
                    seen.add(k)
                    todo += [v for v in eqns[k].invars if _is_var(v) and v in producer]
            return seen

        outvars = jaxpr.outvars
        cones = {i: cone([outvars[i]]) for i in self.which}
        # Grow the early set one result at a time, each time by the result that adds the
        # least work to phase 1 (the most bytes among equals); keep the best prefix.
        best, best_score, union, left = set(), 0, set(), list(self.which)
        while left:
            i = min(left, key=lambda j: (sum(cost[k] for k in cones[j] - union),
                                         -_nbytes(outvars[j])))
            union |= cones[i]
            riders = {j for j in self.which if cones[j] <= union}  # ready at no extra work
            left = [j for j in left if j not in riders]
            score = sum(_nbytes(outvars[j]) for j in riders) * (
                total - sum(cost[k] for k in union))
            if score > best_score:
                best, best_score = riders, score
        if jaxpr.effects:  # an ordered side effect must keep its place: do not cut
            best = set()
        self.early = [i for i in self.which if i in best]
        self.late = [i for i in self.which if i not in best]
        first = set().union(*(cones[i] for i in self.early)) if self.early else set()
        self.phase1 = [e for k, e in enumerate(eqns) if k in first]
        self.phase2 = [e for k, e in enumerate(eqns) if k not in first]
        self.flops = (sum(cost[k] for k in first), total - sum(cost[k] for k in first))
        made = {v for e in self.phase2 for v in e.outvars}
        # What phase 2 reads from before it: held back with the token.
        self.crossing = list(dict.fromkeys(
            v for e in self.phase2 for v in e.invars if _is_var(v) and v not in made))

    def run(self, args, start, hold):
        """Evaluate the program on the flat ``args`` (tracers, inside jit): phase 1, then
        ``start(early values)`` (it returns a token), ``hold(token, values)`` on what phase 2
        reads (it returns both, held: lax.optimization_barrier), then phase 2. Returns the
        token and every output."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars, args))
        _evaluate(self.phase1, env)
        outvars = self.jaxpr.outvars
        token = start([_read(env, outvars[i]) for i in self.early])
        token, held = hold(token, [env[v] for v in self.crossing])
        env.update(zip(self.crossing, held))
        _evaluate(self.phase2, env)
        return token, [_read(env, v) for v in outvars]


def _unwrap(closed):
    """The program of a traced function, and its constants: a jitted function traces to
    one call of its own program, so look inside it."""
    jaxpr, consts = closed.jaxpr, list(closed.consts)
    while (len(jaxpr.eqns) == 1 and "jaxpr" in jaxpr.eqns[0].params
           and list(jaxpr.eqns[0].invars) == list(jaxpr.invars)
           and list(jaxpr.eqns[0].outvars) == list(jaxpr.outvars)
           and not jaxpr.eqns[0].effects):
        inner = jaxpr.eqns[0].params["jaxpr"]
        if not hasattr(inner, "consts"):
            break
        jaxpr, consts = inner.jaxpr, list(inner.consts)
    return jaxpr, consts


# Primitives that map elements to elements (with scalars or broadcasts beside them): XLA
# fuses a chain of them into one pass, which may also read the shadow.
ELEMENTWISE = frozenset("""
    abs add and broadcast_in_dim clamp convert_element_type copy copy_p div eq exp exp2
    expand_dims ge gt integer_pow le log log1p logistic lt max min mul ne neg not or pow
    reshape rsqrt select_n sign sqrt square squeeze sub tanh
""".split())
# Primitives whose result is affine in any of their operands (Tail.nonlinear; mul, div and
# select_n are affine in some operands only).
AFFINE = frozenset("""
    add sub neg copy copy_p reshape squeeze expand_dims broadcast_in_dim
""".split())
# Primitives that only reshape the one array they read (Tail._gradient_work).
SHAPING = frozenset("copy copy_p reshape squeeze expand_dims broadcast_in_dim".split())
# Reductions that Tail's ``statistics`` computes from the values that cross (a global norm).
REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min".split())


def _affine(eqn, hit):
    """Whether ``eqn``'s result is affine in the operands that ``hit`` marks (a list of
    bools, one an operand)."""
    name = eqn.primitive.name
    return (name in AFFINE
            or (name == "convert_element_type"
                and np.issubdtype(eqn.params["new_dtype"], np.floating))
            or (name == "mul" and sum(hit) == 1)
            or (name == "div" and hit == [True, False])
            or (name == "select_n" and not hit[0]))


def _widens(eqn, producer, tail):
    """Whether ``eqn`` converts a value made outside ``tail`` (the program's equations
    there) from a narrower float to float32, exactly."""
    if eqn.primitive.name != "convert_element_type" or not _is_var(eqn.invars[0]):
        return False
    import jax.numpy as jnp
    src, dst = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
    return (producer.get(eqn.invars[0]) not in tail and np.dtype(dst) == np.float32
            and jnp.issubdtype(src, jnp.floating) and np.dtype(src).itemsize < 4)


class Tail:
    """A traced program, cut before the elementwise tail of its results at ``which``.

    A training step ends with its update, ``p + (momentum * v - lr * g)`` and the like:
    elementwise work that XLA fuses into one pass over the parameters. ``tail`` is that
    work: every equation, reached backward from those results through elementwise
    equations only, whose values nothing outside the tail needs. ``crossing`` lists what
    the tail reads from the work before it (the gradients). pympgu.xla.correct_during adds
    the one-step-delayed correction to the tail, so that XLA fuses it into the update.

    With ``finish``, work in that tail that reads values from before it alone and is not
    affine in them (the division that ends a batch norm scale's gradient) goes before it,
    so that the tail is affine in what it reads wherever the update is affine in its
    gradients. Without, ``finishing`` lists such work that reads two values or more: there
    what crosses may be parts of a gradient rather than the gradient. A value from before
    that the tail only widens to float32 (a bfloat16 product's result) is widened before
    it, so that what crosses is float32.

    With ``statistics``, a reduction that the tail reads, computed by elementwise work from
    values that cross (and the state, constants), joins the tail with that work: the norm
    of the gradients by which a clipped update scales them (Model's ``clip_norm``) is then
    the norm of what crosses, the mean gradients, as DDP's clip_grad_norm_ computes it, not
    a mean of the ranks' own norms. ``finishing`` does not count the values that such a
    statistic reads: a global norm reads every gradient whole.
    """

    def __init__(self, closed, which, finish=False, statistics=False):
        jaxpr, consts = _unwrap(closed)
        self.jaxpr, self.consts = jaxpr, consts
        eqns = jaxpr.eqns
        producer, users = {}, {}
        for k, eqn in enumerate(eqns):
            for v in eqn.outvars:
                producer[v] = k
            for v in eqn.invars:
                if _is_var(v):
                    users.setdefault(v, set()).add(k)
        tail, todo = set(), [jaxpr.outvars[i] for i in which]
        while todo:
            v = todo.pop()
            k = producer.get(v) if _is_var(v) else None
            if k is None or k in tail or eqns[k].primitive.name not in ELEMENTWISE:
                continue
            tail.add(k)
            todo += eqns[k].invars
        # An equation whose values work outside the tail reads must come before it, and so
        # must what it reads; with ``finish``, so must the work that may finish a gradient.
        while True:
            if statistics:
                self._statistics(tail, producer, users)
            leaving = {k for k in tail
                       if any(users.get(v, set()) - tail for v in eqns[k].outvars)}
            if not leaving:
                # A value from before that the tail widens (a bfloat16 product's result,
                # pympgu.precision) crosses widened: exactly the same values, in the
                # float32 that the exchange moves and averages.
                leaving = {k for k in tail if _widens(eqns[k], producer, tail)}
            if finish and not leaving:
                leaving = self._gradient_work(tail, producer, every=True)
            if not leaving:
                break
            tail -= leaving
        # Where the gradients' road must feed the update the mean gradients, not averages
        # that make them (pympgu.xla.gradient_plan).
        self.finishing = [eqns[k] for k in sorted(self._gradient_work(tail, producer, False))]
        self.before = [e for k, e in enumerate(eqns) if k not in tail]
        self.tail = [e for k, e in enumerate(eqns) if k in tail]
        made = {v for e in self.before for v in e.outvars}
        self.crossing = list(dict.fromkeys(
            v for e in self.tail for v in e.invars if _is_var(v) and v in made))
        made = {v for e in self.tail for v in e.outvars}
        self._made = [i for i, v in enumerate(jaxpr.outvars) if _is_var(v) and v in made]

    def _statistics(self, tail, producer, users):
        """Adds to ``tail`` each reduction that it reads whose operands come, through
        elementwise work that only the reduction needs, from the tail's values and values
        that cross (one at least), the program's inputs and constants; until none is
        left."""
        eqns = self.jaxpr.eqns
        while True:
            crossing = {v for k in tail for v in eqns[k].invars
                        if _is_var(v) and producer.get(v, k) not in tail}  # not inputs
            grown = False
            for v in crossing:
                k = producer[v]
                if k in tail or eqns[k].primitive.name not in REDUCTIONS:
                    continue
                work, todo, reads, other = {k}, list(eqns[k].invars), False, False
                while todo and not other:
                    u = todo.pop()
                    if not _is_var(u) or producer.get(u) is None:
                        continue
                    j = producer[u]
                    reads |= u in crossing or j in tail
                    if u in crossing or j in work or j in tail:
                        continue
                    other = eqns[j].primitive.name not in ELEMENTWISE  # not a statistic
                    work.add(j)
                    todo += eqns[j].invars
                # Its work must leave nothing that the rest of the program needs.
                if reads and not other and all(users.get(u, set()) <= tail | work
                                               for j in work for u in eqns[j].outvars):
                    tail |= work
                    grown = True
            if not grown:
                return

    def _gradient_work(self, tail, producer, every):
        """The tail's equations that may finish computing a gradient rather than apply
        one: equations not affine in what they read that read values from before the tail
        alone (and constants), two or more of them, or any number with ``every``, and the
        tail's equations they read. Values from before that one shapes from another
        (squeeze, reshape) count as one. A batch norm's scale gets its gradient so, after
        PyTensor's rewrites: a sum over the batch divided by another."""
        eqns, jaxpr = self.jaxpr.eqns, self.jaxpr
        inputs, constants = set(jaxpr.invars), set(jaxpr.constvars)

        def root(v):  # the value from before that v is a reshaping of
            while producer.get(v) is not None and producer[v] not in tail:
                e = eqns[producer[v]]
                if e.primitive.name not in SHAPING or len(e.invars) != 1:
                    break
                v = e.invars[0]
            return v

        sources, taken = {}, set()  # a tail value: the values from before that it reads
        for k in sorted(tail):
            e, read = eqns[k], set()
            if e.primitive.name in REDUCTIONS:  # a statistic (``statistics``): reads all
                sources.update((v, set()) for v in e.outvars)
                continue
            for v in e.invars:
                if not _is_var(v) or v in constants:
                    continue
                v = v if producer.get(v) in tail else root(v)
                if v in inputs or (producer.get(v) in tail and v not in sources):
                    read = None  # it reads the state (squeezed, say), or what reads it
                    break
                read |= sources[v] if producer.get(v) in tail else {v}
            if read is None:
                continue
            sources.update((v, read) for v in e.outvars)
            hit = [_is_var(v) and v not in constants for v in e.invars]
            if (every or len(read) >= 2) and not _affine(e, hit):
                taken.add(k)

        def read_in_tail(k):
            return [v for v in eqns[k].invars if _is_var(v) and producer.get(v) in tail]

        todo = [v for k in taken for v in read_in_tail(k)]
        while todo:
            k = producer[todo.pop()]
            if k not in taken:
                taken.add(k)
                todo += read_in_tail(k)
        return taken

    def nonlinear(self):
        """The first tail equation at which the tail's results stop being affine in the
        crossing values (a product of two of them, a function such as sqrt of one), or None.

        An update affine in its gradients commutes with their mean: when every rank starts
        from the same state, the update of the ranks' mean gradient is the mean of the ranks'
        updates (pympgu.xla.average_gradients)."""
        depends = set(self.crossing)
        for e in self.tail:
            hit = [_is_var(v) and v in depends for v in e.invars]
            if not any(hit):
                continue
            if not _affine(e, hit):
                return e
            depends.update(e.outvars)
        return None

    def reads(self, positions):
        """Whether the tail reads any of the program's inputs at ``positions``."""
        inputs = {self.jaxpr.invars[i] for i in positions}
        return any(_is_var(v) and v in inputs for e in self.tail for v in e.invars)

    def made(self):
        """The program's results that the tail computes."""
        return list(self._made)

    def computed_before(self, positions):
        """Those of the results at ``positions`` that the work before the tail computes:
        not the tail, and neither an input passed through nor a constant."""
        outvars, made = self.jaxpr.outvars, set(self.made())
        inputs = set(self.jaxpr.invars)
        return [i for i in positions
                if i not in made and _is_var(outvars[i]) and outvars[i] not in inputs]

    def rest(self):
        """The program's results that the tail does not compute."""
        made = set(self.made())
        return [i for i in range(len(self.jaxpr.outvars)) if i not in made]

    def evaluate_before(self, args):
        """The work before the tail, on the flat ``args``: the crossing values, then the
        results at ``rest()``."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars, args))
        _evaluate(self.before, env)
        outvars = self.jaxpr.outvars
        return [env[v] for v in self.crossing] + [_read(env, outvars[i]) for i in self.rest()]

    def evaluate_tail(self, args, crossing, parts):
        """The tail, on the flat ``args`` and values of ``crossing``, in parts. ``parts``
        lists groups of positions in ``crossing`` and a function for each, called before
        the equations that need that group (and none after it) with the values of the group
        and the results of the equations before, and returning values for the group; the
        tail's equations that need no crossing value go with the first group. Returns the
        tail's results (None for the others)."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars, args))
        order = {}
        for g, (group, _) in enumerate(parts):
            for i in group:
                order[self.crossing[i]] = g
        # The last group each equation needs, through the tail's own values too.
        need = dict(order)
        split = [[] for _ in parts]
        for e in self.tail:
            g = max((need[v] for v in e.invars if _is_var(v) and v in need), default=0)
            need.update((v, g) for v in e.outvars)
            split[g].append(e)
        earlier = []
        for (group, take), eqns in zip(parts, split):
            values = take([crossing[i] for i in group], list(earlier))
            env.update(zip((self.crossing[i] for i in group), values))
            _evaluate(eqns, env)
            earlier += [env[v] for e in eqns for v in e.outvars]
        made = set(self.made())
        return [_read(env, v) if k in made else None for k, v in enumerate(self.jaxpr.outvars)]

    def run(self, args, hold):
        """Evaluate the program on the flat ``args`` (tracers, inside jit): the work before
        the tail, then ``hold(values of crossing)``, which returns those values, held, and
        anything else, then the tail on the held values. Returns every output and what else
        ``hold`` returned."""
        env = dict(zip(self.jaxpr.constvars, self.consts))
        env.update(zip(self.jaxpr.invars, args))
        _evaluate(self.before, env)
        held, other = hold([env[v] for v in self.crossing])
        env.update(zip(self.crossing, held))
        _evaluate(self.tail, env)
        return [_read(env, v) for v in self.jaxpr.outvars], other


def _read(env, v):
    return env[v] if _is_var(v) else v.val


def _evaluate(eqns, env):
    """Bind each equation in turn, as jax.core.eval_jaxpr does for a whole program."""
    for eqn in eqns:
        env.update(zip(eqn.outvars, bind(eqn, [_read(env, v) for v in eqn.invars])))


def bind(eqn, values, **changed):
    """The results (a list) of ``eqn``'s primitive on ``values``, with its parameters, as
    tracing gave them but for those in ``changed``."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(params, tuple):  # JAX before 0.7 returned (subfuns, params)
        subfuns, params = params
    params = {**params, **changed}
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is not None:
        with manager:
            out = eqn.primitive.bind(*subfuns, *values, **params)
    else:
        out = eqn.primitive.bind(*subfuns, *values, **params)
    return out if eqn.primitive.multiple_results else [out]


def trace(fn, args, inline=False):
    """``fn``'s program for these flat arguments (arrays or tracers), with ``fn`` returning
    a flat sequence of arrays. ``inline``: the equations of the jitted functions it calls
    too, in its own program (jax.disable_jit), where a cut can see them; it also unrolls
    loops with a fixed count."""
    import contextlib

    import jax
    shapes = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in args]
    with jax.disable_jit() if inline else contextlib.nullcontext():
        return jax.make_jaxpr(lambda *a: list(fn(*a)))(*shapes)
