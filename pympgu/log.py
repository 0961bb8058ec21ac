"""pympgu's messages to its user: one logger, ``pympgu``, one line a message, the fix named.
As a library pympgu leaves handlers to the application (Python then shows its warnings and
errors alone); its commands call ``setup``, which prints ``pympgu: message`` on stderr at
the level that ``-q`` and ``-v`` choose."""
import logging
import sys

log = logging.getLogger("pympgu")


class _Stderr(logging.Handler):
    """Writes to whatever sys.stderr is when a message comes (a test may have swapped it)."""

    def emit(self, record):
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def setup(verbosity=0):
    """Show pympgu's messages on stderr: warnings alone below 0 (``-q``), everything that a
    run says at 0, its runtime's own logs too above 0 (``-v``). Calling it again sets the
    level anew."""
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("pympgu: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0
                 else logging.DEBUG)
    return log
