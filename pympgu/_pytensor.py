"""PyTensor, imported with the flag pympgu needs: float32 as floatX (PyTensor's JAX backend
then traces float32 programs). The flag must be set before PyTensor's first import.

PyTensor writes the Python source of each function it compiles to a temporary file of its
own that it never removes (its tracebacks read it): here those files go into one directory
of this process's, removed as it exits. (A run's workers exit without Python's cleanup;
their temporary directory is the run's own, which their launcher removes.)
"""
import os


def import_pytensor():
    """PyTensor with float32 as floatX, its compiled sources kept from piling up."""
    flags = os.environ.get("PYTENSOR_FLAGS", "")
    if "floatX" not in flags:
        os.environ["PYTENSOR_FLAGS"] = ",".join(f for f in (flags, "floatX=float32") if f)
    import pytensor
    _private_sources()
    return pytensor


def _private_sources():
    import atexit
    import functools
    import shutil
    import tempfile
    try:
        from pytensor.link import utils
    except ImportError:
        return
    if getattr(utils, "_pympgu_sources", None) or not hasattr(utils, "NamedTemporaryFile"):
        return
    directory = tempfile.mkdtemp(prefix="pympgu-sources-")
    atexit.register(shutil.rmtree, directory, True)
    utils.NamedTemporaryFile = functools.partial(tempfile.NamedTemporaryFile, dir=directory)
    utils._pympgu_sources = directory
