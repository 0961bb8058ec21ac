"""A run's --out directory, held open: every file in it is written through the directory's
descriptor, created exclusively and never through a link (docs/DECISIONS.md, "Writing
--out").

A directory that another user owns, or that others may write, could hold links named like
the run's files, or be swapped for one that does: such an --out is refused, naming why,
before any worker starts. Inside a directory of the user's own, no one else can plant a
link, and each file is still opened with O_NOFOLLOW, so that not even the user's own link
is written through.
"""
import errno
import os
import re
import secrets
import stat

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{8}\.tmp")
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class OutDirError(OSError):
    """An --out that cannot be written safely, or a file in it that cannot be written."""


def _ancestors_safe(real):
    """Why a directory above ``real`` would let another user swap it, or None: each that
    exists must be this user's or root's, and writable by others only with the sticky bit
    (as /tmp); those still to be made will be this user's."""
    me = os.geteuid()
    parent = os.path.dirname(real)
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (0, me):
            return f"{parent} above it belongs to uid {st.st_uid}, who could swap it"
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            return (f"{parent} above it is writable by every user "
                    f"({stat.filemode(st.st_mode)}), who could swap it")
        if parent == os.path.dirname(parent):
            return None
        parent = os.path.dirname(parent)


class OutDir:
    """The directory ``path`` (made, parents and all, with ``create``), checked and held
    open. Raises OutDirError saying why it cannot be used."""

    def __init__(self, path, create=True):
        self.path = path
        real = os.path.realpath(path)
        try:
            if os.path.islink(path) and os.lstat(path).st_uid not in (0, os.geteuid()):
                raise OutDirError(f"{path} is a link of uid {os.lstat(path).st_uid}")
            why = _ancestors_safe(real)
            if why:
                raise OutDirError(why)
            if create:
                os.makedirs(real, exist_ok=True)
            self.fd = os.open(real, _DIR)
        except OutDirError:
            raise
        except OSError as e:
            raise OutDirError(f"{path}: {e.strerror or e}") from None
        st = os.fstat(self.fd)
        problem = None
        if st.st_uid != os.geteuid():
            problem = (f"{path} belongs to uid {st.st_uid}, not to this user: give an --out "
                       "of your own")
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            problem = (f"{path} is writable by other users ({stat.filemode(st.st_mode)}): "
                       f"chmod go-w {path}, or give another --out")
        if problem:
            self.close()
            raise OutDirError(problem)

    def __repr__(self):
        return f"OutDir({self.path!r})"

    def join(self, name):
        """The path of ``name`` in the directory, for messages."""
        return os.path.join(self.path, name)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- reading

    def exists(self, name):
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def links(self, names):
        """Those of ``names`` that are links in the directory."""
        found = []
        for name in names:
            try:
                if stat.S_ISLNK(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode):
                    found.append(name)
            except FileNotFoundError:
                pass
        return found

    def mtime_ns(self, name):
        """When ``name`` was last written (ns), or None where there is none."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mtime_ns
        except OSError:
            return None

    def open_read(self, name, mode="rb"):
        """``name`` opened for reading, never through a link."""
        fd = self._open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return os.fdopen(fd, mode)

    def read_bytes(self, name):
        with self.open_read(name) as f:
            return f.read()

    # ---------------------------------------------------------------- writing

    def write(self, name, data):
        """Replace ``name`` atomically with ``data``: bytes, or a function that writes to
        the binary file it is given. A crash leaves the previous file whole."""
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"  # _TEMPORARY
        fd = self._open(tmp, _NEW, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self.remove(tmp)
            raise

    def write_text(self, name, text):
        self.write(name, text.encode())

    def copy(self, name, to):
        """Replace ``to`` atomically with a copy of ``name``."""
        with self.open_read(name) as src:
            self.write(to, lambda f: _copy(src, f))

    def rename(self, name, to):
        os.replace(name, to, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove(self, name):
        """Remove ``name`` if it is there (a link is removed, never followed)."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def remove_temporaries(self):
        """Remove the temporary files a writer stopped midway left (write's own names)."""
        for name in os.listdir(self.fd):
            if _TEMPORARY.fullmatch(name):
                self.remove(name)

    def open_append(self, name, truncate=False):
        """``name`` opened for appending text lines (emptied first with ``truncate``)."""
        flags = (os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                 | (os.O_TRUNC if truncate else os.O_APPEND))
        return os.fdopen(self._open(name, flags, 0o644), "w")

    def _open(self, name, flags, mode=0o644):
        if os.sep in name or name in (".", ".."):
            raise ValueError(f"{name!r}: a file of the directory itself, not a path")
        try:
            return os.open(name, flags, mode, dir_fd=self.fd)
        except OSError as e:
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                raise OutDirError(f"{self.join(name)} is a link: pympgu writes no file "
                                  "through one; remove it") from None
            raise


def _copy(src, dst, chunk=1 << 20):
    while block := src.read(chunk):
        dst.write(block)

