"""pympgu: data-parallel training of one network on several GPUs of one machine.

Replicas' parameters are averaged GPU to GPU by one fused kernel that reads peers' memory
through CUDA IPC mappings. The kernel is also callable directly on device arrays from any
framework: :func:`average` and :func:`average_many`.
"""
__version__ = "0.1.0"

from .errors import CudaError, ExchangeError

try:
    from ._host import host_average
except ImportError as exc:  # an uncompiled source tree
    raise ImportError(
        "pympgu's compiled extension is not built. From the source tree run ./build.sh "
        "(in place) or pip install . first."
    ) from exc

from . import cuda


def cuda_available():
    """True when pympgu was built with CUDA and at least one GPU is usable here."""
    return cuda.availability()[0]


def cuda_unavailable_reason():
    """Why CUDA is not usable here (None when it is)."""
    ok, value = cuda.availability()
    return None if ok else value


def average(inputs, out=None, stream=None, synchronize=True):
    """Mean of device arrays in rank order, written to out (default inputs[0]); one launch.

    Any framework's arrays work (``__cuda_array_interface__`` or DLPack): CuPy, PyTorch,
    JAX, pympgu's own DeviceArray. See ``pympgu.cuda.average`` for the rules.
    """
    return cuda.average(inputs, out, stream=stream, synchronize=synchronize)


def average_many(replicas, outs=None, stream=None, synchronize=True):
    """Average many tensors per replica in a single launch (``pympgu.cuda.average_many``)."""
    return cuda.average_many(replicas, outs, stream=stream, synchronize=synchronize)


__all__ = ["CudaError", "ExchangeError", "average", "average_many", "cuda", "cuda_available",
           "cuda_unavailable_reason", "host_average", "__version__"]
