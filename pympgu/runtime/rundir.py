"""A run's private directory (mode 0700, a random name): the launcher's control socket, and
its workers' temporary files. No other user can reach into it, and it goes with the run
(docs/DECISIONS.md, "Who may connect").
"""
import os
import shutil
import stat
import tempfile

SOCKET = "control"
UNIX_PATH_MAX = 100  # sun_path holds 108 bytes; a little room kept


def _base():
    """Where the run's directory goes: the user's runtime directory where it has one of
    its own, else the temporary directory, as long as a socket's path fits."""
    here = os.environ.get("XDG_RUNTIME_DIR")
    if here:
        try:
            st = os.stat(here)
            if st.st_uid == os.geteuid() and not st.st_mode & 0o077:
                return here
        except OSError:
            pass
    base = tempfile.gettempdir()
    if len(os.path.join(base, "pympgu-xxxxxxxx", SOCKET)) > UNIX_PATH_MAX:
        return "/tmp"
    return base


class RunDir:
    """The directory, made at once; ``remove()`` takes it and everything in it."""

    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="pympgu-", dir=_base())  # 0700, exclusively
        st = os.lstat(self.path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(f"{self.path}: not a private directory of this user")
        self.tmp = os.path.join(self.path, "tmp")
        os.mkdir(self.tmp, 0o700)

    @property
    def control(self):
        """The launcher's control endpoint inside it."""
        return f"ipc://{os.path.join(self.path, SOCKET)}"

    def remove(self):
        remove(self.path)


def remove(path):
    """Remove a run's directory and what it holds; never raises."""
    shutil.rmtree(path, ignore_errors=True)


def use_for_temporary_files(path):
    """Make ``path`` this process's temporary directory, for it and what it starts (PyTensor
    writes each compiled function's source there): they go with the run."""
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path
