"""pympgu: data-parallel training of one network on several GPUs.

Replicas' parameters are averaged GPU to GPU by fused kernels that read peers' memory
through CUDA IPC mappings. The kernels are also callable directly on device arrays from any
framework: :func:`average` and :func:`average_many`; :mod:`pympgu.xla` runs them inside a
jitted JAX function, :mod:`pympgu.ddp` inside PyTorch's DDP.

Packages, one concern each, calls running down the list: training (``python -m
pympgu.train``), bench (``python -m pympgu.bench``), xla (the exchange as XLA operations),
exchange (the Exchanger: a worker's arrays averaged with its peers'), runtime (the run's
processes: launcher, workers, control plane, shared memory), _cuda (the compiled CUDA
layer; ``pympgu.cuda`` is its front). Beside them: models, nnet, data, precision, schedule
(what is trained), methods (the exchange methods' registry), settings (the PYMPGU_*
environment variables), log, evaluate, ddp.
"""
import sys as _sys

__version__ = "0.1.0"


def _installed_elsewhere():
    """The directory of an installed pympgu other than this source tree, or None.

    ``python -m pympgu.train`` run in the repository's root imports the source tree (the
    current directory comes first on sys.path), whose extension may not be built when
    pympgu was installed with pip: the installed copy is then the one meant."""
    import importlib.machinery
    import os
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for entry in _sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if path == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec(__name__, [path])
        if spec is not None and spec.submodule_search_locations:
            return list(spec.submodule_search_locations)[0]
    return None


try:
    from ._host import host_average
except ImportError as _exc:  # an uncompiled source tree
    _elsewhere = _installed_elsewhere()
    if _elsewhere is None:
        raise ImportError(
            "pympgu's compiled extension is not built. From the source tree run ./build.sh "
            "(in place) or pip install . first.") from _exc
    # Become the installed package: its modules, and its own __init__ run in this one.
    __path__[:] = [_elsewhere]
    __file__ = f"{_elsewhere}/__init__.py"
    with open(__file__) as _f:
        exec(compile(_f.read(), __file__, "exec"))
else:
    from . import cuda
    from .errors import CudaError, ExchangeError

    def cuda_available() -> bool:
        """True when pympgu was built with CUDA and at least one GPU is usable here."""
        return cuda.availability()[0]

    def cuda_unavailable_reason() -> str | None:
        """Why CUDA is not usable here (None when it is)."""
        ok, value = cuda.availability()
        return None if ok else value

    def average(inputs, out=None, stream=None, synchronize=True) -> object:
        """Mean of device arrays in rank order, written to out (default inputs[0]); one launch.

        Any framework's arrays work (``__cuda_array_interface__`` or DLPack): CuPy, PyTorch,
        JAX, pympgu's own DeviceArray. See ``pympgu.cuda.average`` for the rules.
        """
        return cuda.average(inputs, out, stream=stream, synchronize=synchronize)

    def average_many(replicas, outs=None, stream=None, synchronize=True) -> list:
        """Average many tensors per replica in a single launch (``pympgu.cuda.average_many``)."""
        return cuda.average_many(replicas, outs, stream=stream, synchronize=synchronize)

    __all__ = ["CudaError", "ExchangeError", "average", "average_many", "cuda",
               "cuda_available", "cuda_unavailable_reason", "host_average", "__version__"]
