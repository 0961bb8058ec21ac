"""A worker's points to go back to, kept where the worker that replaces it finds them: files
in the launcher's private directory, which outlives its workers and goes with the run.

A node that starts every worker again (GPU workers') leaves no survivor to hand the new ones
its state; with these files each new worker takes up its predecessor's, the node's own
(docs/DECISIONS.md, "A node's state outlives its workers"). One file a kept point, written
once, then the slot's index naming the points and the loop's history; each written under a
temporary name and renamed, so that a worker killed while writing leaves the last index and
every file it names whole. Pickle, as the directory is this user's alone (mode 0700).
"""
import os
import pickle

SUFFIX = ".tmp"


def _write(path, value):
    with open(path + SUFFIX, "wb") as f:
        # Protocol 5 writes an array's buffer as it is: one copy, to the page cache.
        pickle.dump(value, f, protocol=5)
    os.replace(path + SUFFIX, path)


def _read(path):
    with open(path, "rb") as f:
        return pickle.load(f)


class Carried:
    """The kept points of the worker in ``slot`` (its link's number, which a replacement
    takes over), under ``where``."""

    def __init__(self, where, slot):
        self.where, self.slot = where, slot
        os.makedirs(where, mode=0o700, exist_ok=True)
        self.index = os.path.join(where, f"slot{slot}")
        self.written = []  # (entry, its file's name) as the index names them
        self.count = 0

    def write(self, kept, extra):
        """Keep the entries of ``kept`` (Recovery's) and ``extra`` (what the loop holds
        beside them: its history), each entry's file written once."""
        names = []
        for entry in kept:
            name = next((n for e, n in self.written if e is entry), None)
            if name is None:
                self.count += 1
                name = f"slot{self.slot}-{os.getpid()}-{self.count}"
                position, values, note, outer = entry
                _write(os.path.join(self.where, name), {
                    "position": position, "values": values, "note": note, "outer": outer})
            names.append((entry, name))
        _write(self.index, {"entries": [(e[0], n) for e, n in names], "extra": extra})
        kept_names = {n for _, n in names}
        for _, n in self.written:
            if n not in kept_names:
                self._remove(n)
        self.written = names

    def read(self):
        """What a predecessor in this slot kept: (entries, extra), or None where it kept
        nothing (lost before its first exchange). What it left half written goes."""
        try:
            index = _read(self.index)
        except FileNotFoundError:
            return None
        entries = []
        for position, name in index["entries"]:
            d = _read(os.path.join(self.where, name))
            entries.append((d["position"], d["values"], d["note"], d["outer"]))
        self.written = list(zip(entries, (n for _, n in index["entries"])))
        named = {n for _, n in self.written} | {os.path.basename(self.index)}
        for n in self._files() - named:
            self._remove(n)
        return entries, index["extra"]

    def forget(self):
        """Remove what this slot keeps: a worker that cannot keep it leaves none behind."""
        for n in self._files():
            self._remove(n)
        self.written = []

    def _files(self):
        """The names of this slot's files: its index, its points, what is half written."""
        index = os.path.basename(self.index)
        try:
            names = os.listdir(self.where)
        except FileNotFoundError:
            return set()
        return {n for n in names if n in (index, index + SUFFIX) or n.startswith(index + "-")}

    def _remove(self, name):
        try:
            os.unlink(os.path.join(self.where, name))
        except FileNotFoundError:
            pass
