"""The CUDA side of pympgu, whether or not it was built.

``from pympgu import cuda`` always works. When the extension was built without a CUDA
toolkit, every name here raises :class:`pympgu.CudaError` saying so; when it was built but
no GPU or driver is usable, CUDA's own error (``cudaErrorInsufficientDriver``,
``cudaErrorNoDevice``) is raised by the first call that needs the device.
"""
from .errors import CudaError

try:
    from . import _cuda
    _BUILD_ERROR = None
except ImportError as exc:  # built without a toolkit, or cudart missing at run time
    _cuda = None
    _BUILD_ERROR = exc

PMG_ERR_NO_CUDA = 10005
CUDA_ERROR_INSUFFICIENT_DRIVER = 35


def _no_cuda():
    return CudaError(PMG_ERR_NO_CUDA, "pmgErrorNoCuda",
                     f"pympgu was built without CUDA ({_BUILD_ERROR}); install a CUDA toolkit "
                     "(nvcc on PATH or CUDA_HOME) and rebuild with ./build.sh or pip install .")


def availability() -> tuple[bool, int | str]:
    """(True, device count) when CUDA works here, else (False, the reason as text)."""
    if _cuda is None:
        return False, str(_no_cuda())
    try:
        n = _cuda.get_device_count()
    except CudaError as e:
        if e.status == CUDA_ERROR_INSUFFICIENT_DRIVER and not _has_driver():
            return False, "no NVIDIA driver here (libcuda.so.1 is not installed)"
        return False, str(e)
    if n == 0:
        return False, "CUDA works but no GPU is visible"
    return True, n


def _has_driver():
    """Whether an NVIDIA driver's library loads here: CUDA calls a missing driver an
    insufficient one."""
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def device_count() -> int:
    """Visible GPUs, or 0 when CUDA is unusable here (never raises)."""
    ok, value = availability()
    return value if ok else 0


def __getattr__(name):
    if _cuda is None:
        if name.startswith("__"):
            raise AttributeError(name)
        raise _no_cuda()
    try:
        return getattr(_cuda, name)
    except AttributeError:
        raise AttributeError(f"module 'pympgu.cuda' has no attribute {name!r}") from None
