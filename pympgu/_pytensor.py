"""PyTensor, imported with the flag pympgu needs: float32 as floatX (PyTensor's JAX backend
then traces float32 programs). The flag must be set before PyTensor's first import."""
import os


def import_pytensor():
    """PyTensor with float32 as floatX."""
    flags = os.environ.get("PYTENSOR_FLAGS", "")
    if "floatX" not in flags:
        os.environ["PYTENSOR_FLAGS"] = ",".join(f for f in (flags, "floatX=float32") if f)
    import pytensor
    return pytensor
