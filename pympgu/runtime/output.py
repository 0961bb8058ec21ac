"""A worker's stdout and stderr, read by its launcher through pipes and passed on line by
line, but for what a C++ runtime logs as it fails: absl's error and fatal lines and the
stack dump after them are held, and a worker killed by SIGABRT is named in one line with
the fatal line's message; held lines that no abort follows are passed on after HOLD_S.
"""
import logging
import os
import re
import sys
import time

log = logging.getLogger("pympgu")

HOLD_S = 2.0
_ABSL = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+[^\]\s]+\] ")
_STACK = "*** Check failure stack trace: ***"
_STATUS = "absl::Status: "


class Output:
    """One of a worker's streams (``name``: 'stdout' or 'stderr'), read from ``fd``, the
    pipe's end in the launcher, and written to the launcher's own stream of that name."""

    def __init__(self, rank, name, fd):
        self.rank, self.name, self.fd = rank, name, fd
        os.set_blocking(fd, False)
        self.partial = b""
        self.held, self.held_since = [], None
        self.fatal = None  # the fatal line's message, once one came
        self.open = True

    def fileno(self):
        return self.fd

    def read(self):
        """Take what the pipe holds now; at its end, pass on what is left."""
        while self.open:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                return
            *lines, self.partial = (self.partial + chunk).split(b"\n")
            for line in lines:
                self._line(line.decode("utf-8", "replace"))

    def _line(self, line):
        if self.fatal is not None:  # the process is going: the rest is its stack
            self.held.append(line)
            return
        absl = _ABSL.match(line)
        if absl or line.startswith(_STACK):
            self.held.append(line)
            self.held_since = self.held_since or time.monotonic()
            if line.startswith(_STACK) or line[0] == "F":
                self.fatal = line[absl.end():] if absl else "a check failed"
            return
        if self.held:  # a line of its own after held ones: they were no failure's
            self.flush()
        self._write(line)

    def _write(self, line):
        stream = sys.stdout if self.name == "stdout" else sys.stderr
        stream.write(line + "\n")
        stream.flush()

    def tick(self, now):
        """Pass on what was held for HOLD_S and that no fatal line followed."""
        if self.held and self.fatal is None and now - self.held_since > HOLD_S:
            self.flush()

    def flush(self):
        for line in self.held:
            self._write(line)
        self.held, self.held_since = [], None

    def close(self):
        """The pipe's end: the partial last line and what was held (but an abort's) go."""
        if not self.open:
            return
        self.open = False
        if self.partial:
            self._line(self.partial.decode("utf-8", "replace"))
            self.partial = b""
        if self.fatal is None:
            self.flush()
        os.close(self.fd)

    def abort_reason(self):
        """Why the worker aborted, in one line (its C++ runtime's fatal message), or None
        where it logged none; the log it held goes to the debug level."""
        if self.fatal is None:
            return None
        for line in self.held:
            log.debug("rank %d's %s: %s", self.rank, self.name, line)
        message = self.fatal
        if _STATUS in message:
            message = message.split(_STATUS, 1)[1]
        return " ".join(message.split())

