"""Every rank's step compiled to the same kernels, so that a norm every rank takes of the
same mean gradients is the same bits on every rank (docs/DECISIONS.md, "Steps compiled
alike"): XLA's fusion autotuner, which times candidate kernels on the rank that compiles,
is turned off for such a step."""
import functools
import os

import numpy as np

# The options, the first this XLA knows taken: the fusion autotuner off alone, which cost
# the wide MLP's step nothing measurable; or every autotuner off, the gemms' too, which did
# (docs/DECISIONS.md, "Steps compiled alike").
ALIKE_OPTIONS = ({"xla_gpu_experimental_enable_fusion_autotuner": False},
                 {"xla_gpu_exclude_nondeterministic_ops": True})
# The same in XLA_FLAGS, for every compile of a process (a step jitted without the
# options), and the stricter --xla_gpu_deterministic_ops, which implies the last.
_ALIKE_FLAGS = tuple(f"--{name}={str(value).lower()}" for options in ALIKE_OPTIONS
                     for name, value in options.items()) + ("--xla_gpu_deterministic_ops=true",)
DETERMINISTIC_FLAG = "--xla_gpu_exclude_nondeterministic_ops=true"  # the documented one


def accepts(options):
    """Whether this process's XLA compiles with jax.jit's ``compiler_options``: it refuses,
    at the compile, an option it does not know (INVALID_ARGUMENT). Any other failure is
    raised: a rank that took it for a refusal would compile its step otherwise than its
    peers."""
    import jax
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
    except jax.errors.JaxRuntimeError as e:
        if "INVALID_ARGUMENT" not in str(e):
            raise
        return False
    return True


@functools.cache
def alike_options():
    """jax.jit's ``compiler_options`` under which every rank compiles a step's reductions
    to the same kernels: {} on a CPU, where XLA's are fixed by the shapes; on GPUs the first
    of ALIKE_OPTIONS that this XLA accepts, or None if it accepts neither."""
    import jax
    if jax.default_backend() == "cpu":
        return {}
    return next((options for options in ALIKE_OPTIONS if accepts(options)), None)


def deterministic_reductions(alike=False):
    """Whether every rank compiles this process's reductions to the same kernels: with
    ``alike`` (the step is jitted with ``compiler_options=alike_options()``), on a CPU, or
    with XLA_FLAGS that turn the fusion autotuner off for every compile (DETERMINISTIC_FLAG,
    or one of the others in _ALIKE_FLAGS; read when JAX's GPU backend starts)."""
    import jax
    flags = os.environ.get("XLA_FLAGS", "").split()
    return (alike or jax.default_backend() == "cpu"
            or any(flag in flags for flag in _ALIKE_FLAGS))
