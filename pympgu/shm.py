"""POSIX shared memory for CPU workers: one segment per rank, named after the run's token.

Segments live in /dev/shm as ``pympgu-<token>-<rank>``, so two runs never clash and the
launcher can unlink whatever a failed run left behind (:func:`unlink_run`). Opened with
os.open/mmap directly: Python's multiprocessing resource tracker would otherwise unlink
segments behind the workers' backs or warn about them at exit.
"""
import glob
import mmap
import os

SHM_DIR = "/dev/shm"


def segment_name(token, rank):
    return f"pympgu-{token}-{rank}"


class Segment:
    """A mapped shared-memory segment; ``buffer`` is a writable memoryview of it."""

    def __init__(self, name, nbytes, create):
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(nbytes, 1))
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"shared memory {self.path} has {size} bytes, expected {nbytes}")
            self.map = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self.buffer = memoryview(self.map)[:nbytes]

    def close(self):
        """Unlink (the creator) and unmap; calling it again does nothing."""
        if self.map is None:
            return
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        try:
            self.buffer.release()
            self.map.close()
        except BufferError:
            # numpy views of the segment are still alive; the mapping goes with them.
            pass
        self.map = None


def unlink_run(token):
    """Remove every segment of the run with this token; returns the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"pympgu-{token}-*")):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
