"""POSIX shared memory for CPU workers: one segment per rank, named after the run's token.

Segments live in /dev/shm as ``pympgu-<token>-<rank>``, so two runs never clash and the
launcher can unlink whatever a failed run left behind (:func:`unlink_run`). Opened with
os.open/mmap directly: Python's multiprocessing resource tracker would otherwise unlink
segments behind the workers' backs or warn about them at exit.
"""
import errno
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
                _allocate(fd, self.path, max(nbytes, 1))
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"shared memory {self.path} has {size} bytes, expected {nbytes}")
            self.map = mmap.mmap(fd, max(nbytes, 1))
        except BaseException:
            if create:
                os.unlink(self.path)
            raise
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


def _allocate(fd, path, nbytes):
    """Give the segment its pages now. A tmpfs extended by ftruncate alone takes its pages
    at the first touch, and one that has run out then kills the process with SIGBUS (a
    container's /dev/shm is 64 MiB unless it is given more): here, an error that says so."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate
            os.ftruncate(fd, nbytes)
            return
        if e.errno != errno.ENOSPC:
            raise
        st = os.statvfs(os.path.dirname(path))
        raise OSError(errno.ENOSPC, f"{path}: {_mib(nbytes)} of shared memory do not fit in "
                      f"{os.path.dirname(path)}, which has {_mib(st.f_bavail * st.f_frsize)} "
                      f"free of {_mib(st.f_blocks * st.f_frsize)}. Each CPU worker keeps "
                      "its model's state there: give it more room (in a container, docker "
                      "run --shm-size), or train a smaller model or on fewer workers") from None


def _mib(nbytes):
    return f"{nbytes / 2 ** 20:,.1f} MiB"


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
