"""POSIX shared memory: CPU workers' segments and the GPU stream barriers' flag pages.

Segments live in /dev/shm as ``pympgu-<run id>-<rank>``, mode 0600, the run id random and
public (it is no key to the run's control plane), so two runs never clash and the launcher
can unlink whatever a failed run left behind (:func:`unlink_run`). A name is unlinked as
soon as every rank has mapped its segment (:meth:`Segment.unlink`); until then a worker
whose launcher is killed removes those it created (:func:`unlink_created`). Only names of
pympgu's own form are opened, and only regular files of this user that no one else can
read: a peer's name is never a path to anything else. Opened with os.open/mmap directly:
Python's multiprocessing resource tracker would otherwise unlink segments behind the
workers' backs or warn about them at exit.
"""
import errno
import glob
import mmap
import os
import re
import stat

SHM_DIR = "/dev/shm"
# pympgu-<run id>-<rank>, or a PeerGroup's flags page: <that>-flags-<hex>, or, outside a
# launcher, pympgu-flags-<pid>-<hex>.
NAME = re.compile(r"pympgu-(?:[0-9a-f]{1,64}-[0-9]{1,3}|flags-[0-9]{1,10})(?:-flags)?"
                  r"(?:-[0-9a-f]{1,32})?")
_created = set()  # paths this process created and has not unlinked


def segment_name(run_id, rank):
    """The prefix of every name rank ``rank`` of run ``run_id`` creates."""
    return f"pympgu-{run_id}-{rank}"


def new_name(prefix):
    """``prefix`` and random digits: a name that no other process can take first."""
    import secrets
    return f"{prefix}-{secrets.token_hex(6)}"


def check_name(name, prefix=None):
    """Refuse a segment name that is not of pympgu's form, or (with ``prefix``) not of the
    run's own: a name from a peer must never reach a path elsewhere."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"refused the shared-memory name {name[:80]!r}: not a pympgu "
                         "segment's")
    if prefix is not None and not (name == prefix or name.startswith(prefix + "-")):
        raise ValueError(f"refused the shared-memory name {name!r}: not this run's "
                         f"({prefix})")
    return name


class Segment:
    """A mapped shared-memory segment; ``buffer`` is a writable memoryview of it."""

    def __init__(self, name, nbytes, create, prefix=None):
        self.name = check_name(name, prefix)
        self.path = os.path.join(SHM_DIR, name)
        self.owner = create
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create
                                                             else 0)
        fd = os.open(self.path, flags, 0o600)
        if create:
            _created.add(self.path)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise PermissionError(errno.EPERM, "refused: not a private file of this user "
                                      f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid})",
                                      self.path)
            if create:
                _allocate(fd, self.path, max(nbytes, 1))
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"shared memory {self.path} has {size} bytes, expected {nbytes}")
            self.map = mmap.mmap(fd, max(nbytes, 1))
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)
        self.buffer = memoryview(self.map)[:nbytes]

    def unlink(self):
        """Remove the name (the creator only; the mappings stay): once every rank has mapped
        the segment, nothing need ever be cleaned up after it."""
        if self.owner and self.path in _created:
            _created.discard(self.path)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self):
        """Unlink (the creator) and unmap; calling it again does nothing."""
        if self.map is None:
            return
        self.unlink()
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


def unlink_created():
    """Remove every name this process created and has not unlinked (a worker whose launcher
    is gone, on its way out)."""
    for path in list(_created):
        _created.discard(path)
        try:
            os.unlink(path)
        except OSError:
            pass


def unlink_run(run_id, log=None):
    """Remove what the run ``run_id`` left in /dev/shm; returns the paths removed. Only
    regular files of this user under the run's names are taken: a directory, link, fifo or
    another user's file squatting a name of the run stays where it is (no other user can
    create a file of ours, and /dev/shm's sticky bit keeps ours from being swapped), and
    nothing here ever fails the run: ``log`` hears of what could not be removed."""
    check_name(segment_name(run_id, 0))
    removed, me = [], os.geteuid()
    for path in glob.glob(os.path.join(SHM_DIR, f"pympgu-{run_id}-*")):
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != me:
                continue  # not this run's: someone else's, left alone
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            if log is not None:
                log(f"could not remove {path} ({e.strerror}); remove it by hand")
    return removed
