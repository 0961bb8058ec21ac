"""pympgu's exception types."""

# cudaErrorStreamCaptureUnsupported (900) to cudaErrorStreamCaptureWrongThread (908): a call
# that a stream being captured into a CUDA graph does not allow.
CAPTURE_STATUSES = range(900, 909)
CAPTURE_HINT = ("a CUDA graph's capture takes PeerGroup.allreduce(..., synchronize=False) on a "
                "group stream joined to the capture (group.stream.wait_for(capturing stream), "
                "then view.order_before(it)), pympgu.ddp's hook, and ModelAverager.average() "
                "once a first call outside the capture has set it up; nothing that waits on "
                "the host (synchronize=True, barrier, copy_average, resident) can be captured")


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
        if self.status in CAPTURE_STATUSES:
            text += f" ({CAPTURE_HINT})"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.status, self.name, self.message, self.context))


class ExchangeError(RuntimeError):
    """A failure of the multi-worker exchange: layouts that differ, a peer that left."""


class SaidWhole(RuntimeError):
    """A failure whose message says it all, the cause and what to do: a worker that raises
    it is named with that one line, without a traceback."""


class FlagError(ValueError):
    """A setting that cannot be honoured (a flag out of range, a batch the data cannot
    fill, a dropout rate for a model without dropout, nodes that cannot meet): ``flag``
    names the flag or variable at fault, and the command line reports it as its parser
    reports a bad flag."""

    def __init__(self, flag, message):
        super().__init__(message)
        self.flag = flag
