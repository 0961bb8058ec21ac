"""A PyTensor function's JAX program, called directly, with pympgu's exchange fused into it.

PyTensor compiles a function with ``mode="JAX"`` into one jitted JAX program that takes the
explicit inputs and every shared variable, and returns the outputs and the updates' new
values; ``Function.__call__`` wraps it in Python bookkeeping. ``JaxStep`` calls the same
program through a jit of its own and stores the updates back into the shared variables
exactly as PyTensor does, so everything else (evaluation, checkpoints) sees the same state.
The point is what else goes into that jit: given ``exchange`` (``StepExchange.
average_results``), the new state is averaged with the other ranks inside the same call,
so a step and its exchange are one dispatch, and the averages of the last layers cross the
link while the step computes the first layers' gradients. Given ``during`` instead
(``StepExchange.correct_during``), the state the step starts from is averaged while the
step computes, and the step's result is corrected by what the average changed (the
one-step-delayed correction of ``--overlap``).
"""
import itertools


class JaxStep:
    """Call ``fn`` (a PyTensor function compiled with mode='JAX') through its JAX program.

    ``state`` lists shared variables that ``fn`` updates. ``exchange``, if given, is called
    as ``exchange(compute, which, *args, local=...)``: ``compute(*args)`` returns the
    program's outputs (a list), ``which`` the positions of ``state``'s new values among
    them, in ``state``'s order, ``local`` the positions in ``args`` of ``fn``'s explicit
    inputs (a rank's minibatch), and ``exchange`` returns the outputs with some of those
    replaced by what they become (the average; ``StepExchange.average_results``, or
    ``average_gradients``, which reads ``inputs`` as ``during`` does). ``during``,
    if given, is called as ``during(old, compute, *args)`` with the values ``state`` starts
    the step with; ``compute(*args)`` returns ``(new, outs)``, the new values of ``state``
    and all of the program's outputs, and ``during`` returns ``(values, outs)``, where
    ``values`` replace a leading part of ``new`` (``StepExchange.correct_during``: each
    becomes new + (average of old - old)). ``inputs`` are arrays that ``during`` reads
    (``StepExchange.shadow``'s): the jitted program takes them after ``fn``'s arguments
    at every call, since closed over they would be copied into it as constants, and hands
    them to ``during`` or ``exchange`` as the keyword ``inputs`` (when there are any).
    Calling returns ``fn``'s outputs: the value itself when there is one, else a list.
    A random generator that ``fn`` draws from (Model.dropout's) is a rank's own input,
    like the minibatch: ``exchange`` is given it in ``local``, as the arrays of its key.
    ``compiler_options`` are jax.jit's, for this program (pympgu.xla.alike_options()).
    ``donate``: the values of the shared variables that ``fn`` updates are given to XLA to
    write the new ones over (nothing else may hold them: the containers get the new ones).
    """

    def __init__(self, fn, state, exchange=None, during=None, inputs=(), compiler_options=None,
                 donate=False):
        import jax
        from pytensor.compile.sharedvalue import SharedVariable
        from pytensor.tensor.random.type import RandomType

        program = getattr(fn.vm, "jit_fn", None)
        if program is None:
            raise TypeError(f"PyTensor function {fn.name!r} was not compiled with mode='JAX'")
        fgraph = fn.maker.fgraph
        variables = [i.variable for i in fn.maker.inputs]  # the program's inputs, in order
        # Generators differ between ranks (Model.dropout draws each rank's own masks): like
        # the minibatch, they are a rank's own inputs.
        noise = [k for k, v in enumerate(variables) if isinstance(v.type, RandomType)]
        # Each shared variable's container, but a generator's: PyTensor's JAX linker gives
        # the function a copy of its own, which holds a JAX key (a dict of arrays).
        containers = [fn.input_storage[k] if k in noise else getattr(v, "container", None)
                      for k, v in enumerate(variables)]
        self.explicit = [k for k, v in enumerate(variables) if not isinstance(v, SharedVariable)]
        self.shared = [(k, containers[k]) for k, v in enumerate(variables)
                       if isinstance(v, SharedVariable)]
        self.nargs = len(variables)
        # update_mapping: program output index -> the input index it updates.
        self.updates = [(out, containers[inp])
                        for out, inp in sorted(fgraph.update_mapping.items())]
        self.nout = len(fgraph.outputs) - len(self.updates)
        nouts = len(fgraph.outputs)
        out_of = {inp: out for out, inp in fgraph.update_mapping.items()}
        position = {id(v): k for k, v in enumerate(variables)}
        missing = [s.name for s in state if out_of.get(position.get(id(s))) is None]
        if missing:
            raise ValueError(f"{fn.name!r} does not update {missing}")
        state_outs = [out_of[position[id(s)]] for s in state]
        state_ins = [position[id(s)] for s in state]

        self.inputs = list(inputs)
        nargs = self.nargs

        def run(*args):
            args, more = args[:nargs], args[nargs:]
            compiled, outs_in, args_in, local = program, state_outs, state_ins, self.explicit
            if noise:
                # A generator's key is a dict of arrays. The exchange traces and cuts the
                # program by the positions of its arrays, so it is shown a program of
                # arrays alone: each argument's leaves in turn, each output's likewise.
                leaves, arg_tree = jax.tree.flatten(list(args))
                first = list(itertools.accumulate(
                    (len(jax.tree.leaves(a)) for a in args), initial=0))
                # An update's result has the structure of what it updates; other results
                # are arrays.
                like = [args[fgraph.update_mapping[o]] if o in fgraph.update_mapping else 0
                        for o in range(nouts)]
                out_tree = jax.tree.structure(like)
                out_first = list(itertools.accumulate(
                    (len(jax.tree.leaves(x)) for x in like), initial=0))

                def compiled(*flat):
                    return jax.tree.leaves(list(program(*jax.tree.unflatten(arg_tree, flat))))

                outs_in = [out_first[o] for o in state_outs]
                args_in = [first[k] for k in state_ins]
                local = [i for k in self.explicit + noise for i in range(first[k], first[k + 1])]
                args = leaves
            outs = self._run(compiled, outs_in, args_in, local, args, more, exchange, during)
            return jax.tree.unflatten(out_tree, outs) if noise else outs

        donated = sorted(set(fgraph.update_mapping.values())) if donate else ()
        self.jitted = jax.jit(run, compiler_options=compiler_options or None,
                              donate_argnums=tuple(donated))

    @staticmethod
    def _run(program, state_outs, state_ins, local, args, more, exchange, during):
        """The program's outputs, a list of arrays, for ``args``, arrays, with the exchange
        of __init__'s ``exchange`` or ``during`` fused in."""
        if during is not None:
            def compute(*args):
                outs = list(program(*args))
                return [outs[o] for o in state_outs], outs

            given = {"inputs": list(more)} if more else {}
            values, outs = during([args[k] for k in state_ins], compute, *args, **given)
            for out, value in zip(state_outs, values):
                outs[out] = value
            return outs
        if exchange is not None:
            given = {"inputs": list(more)} if more else {}
            return list(exchange(lambda *a: list(program(*a)), state_outs, *args,
                                 local=local, **given))
        return list(program(*args))

    def arguments(self, *inputs):
        """The jitted program's arguments for these explicit inputs (``jitted.lower`` takes
        them too, to inspect the compiled program)."""
        if len(inputs) != len(self.explicit):
            raise TypeError(f"expected {len(self.explicit)} inputs, got {len(inputs)}")
        args = [None] * self.nargs
        for k, value in zip(self.explicit, inputs):
            args[k] = value
        for k, container in self.shared:
            args[k] = container.storage[0]
        return args + self.inputs

    def __call__(self, *inputs):
        outs = self.jitted(*self.arguments(*inputs))
        for out, container in self.updates:
            container.storage[0] = outs[out]
        results = outs[:self.nout]
        return results[0] if self.nout == 1 else results
