"""pympgu's exception types."""


class CudaError(RuntimeError):
    """A CUDA runtime (or pympgu argument) failure, with CUDA's own error name and message.

    ``status`` is the numeric cudaError_t (or a pympgu code >= 10000), ``name`` its symbolic
    name (``cudaErrorInsufficientDriver``) and ``message`` CUDA's description. It pickles, so
    a worker's failure survives the trip to the launcher.
    """

    def __init__(self, status, name, message, context=None):
        self.status = int(status)
        self.name = name
        self.message = message
        self.context = context
        text = f"{name} ({self.status}): {message}"
        if context:
            text = f"{context}: {text}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.status, self.name, self.message, self.context))


class ExchangeError(RuntimeError):
    """A failure of the multi-worker exchange: layouts that differ, a peer that left."""
