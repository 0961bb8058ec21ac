"""What another local user (nobody) can do to a root run: squat its names, flood its ports,
plant links in its --out, hand it a secret: each ends as a refusal naming the cause, or as
a clean run. Most tests need root, to act as the other user."""
import glob
import os
import shutil
import tempfile

import pytest

from pympgu.runtime import control, protocol, shm
from pympgu.runtime import launch
from pympgu.training import checkpoint as ckpt
from pympgu.training import cli
from pympgu.training.outdir import OutDir, OutDirError
from processes import as_nobody
from runtime_targets import squat, average_then_squat

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user: needs root")]


def _remove(paths):
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


def test_names_of_the_run_squatted_by_another_user_are_left_alone():
    run_id = protocol.new_run_id()
    squatted = [f"/dev/shm/pympgu-{run_id}-0-{k}" for k in range(4)]
    own = f"/dev/shm/pympgu-{run_id}-1-own"
    open(own, "w").close()
    logs = []
    try:
        as_nobody(squat, squatted)
        assert shm.unlink_run(run_id, log=logs.append) == [own]
        assert all(os.path.lexists(p) for p in squatted) and not logs
    finally:
        _remove(squatted + [own])


def test_a_run_whose_names_are_squatted_ends_cleanly():
    try:
        results = launch(average_then_squat, (5,), cpu=2)
        assert results[0] == results[1]
        assert all(os.path.lexists(p) for p in results[0])  # another user's: not ours
    finally:
        _remove(glob.glob("/dev/shm/pympgu-*-squat*"))


# --out: nothing written through another user's directory or link.

def _plant(directory, victim, mode=None):
    """Another user's directory, holding links named like a run's files to ``victim``."""
    os.mkdir(directory)
    for name in ckpt.FILES:
        os.symlink(victim, os.path.join(directory, name))
    if mode is not None:
        os.chmod(directory, mode)


@pytest.fixture
def victim(tmp_path):
    """A file of root's that a run must never write: its contents, checked at the end."""
    path = tmp_path / "victim"
    path.write_bytes(b"root's own")
    os.chmod(tmp_path, 0o755)  # nobody may reach it through the links
    yield str(path)
    assert path.read_bytes() == b"root's own"


def _refused(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", "2", "--epochs", "1", "--quiet", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_an_out_of_another_users_making_is_refused(victim, capsys):
    top = tempfile.mkdtemp(prefix="pympgu-test-")
    os.chmod(top, 0o1777)  # as /tmp: anyone may make a directory there
    try:
        planted = os.path.join(top, "planted")
        as_nobody(_plant, planted, victim)
        err = _refused(["--out", planted], capsys)
        assert f"--out {planted} belongs to uid 65534, not to this user" in err, err
        # One level down: the directory above is the other user's to swap.
        as_nobody(os.chmod, planted, 0o777)
        err = _refused(["--out", os.path.join(planted, "run")], capsys)
        assert f"{planted} above it belongs to uid 65534" in err, err
        assert not os.path.exists(os.path.join(planted, "run"))
        # A directory of this user's that anyone may write: links could appear in it.
        shared = os.path.join(top, "shared")
        os.mkdir(shared)
        os.chmod(shared, 0o777)
        err = _refused(["--out", shared], capsys)
        assert f"--out {shared} is writable by other users (drwxrwxrwx): chmod go-w" in err
        # This user's own link among the run's names: not written through either.
        own = os.path.join(top, "own")
        os.mkdir(own)
        os.symlink(victim, os.path.join(own, ckpt.METRICS))
        err = _refused(["--out", own], capsys)
        assert f"--out {own} holds a link named {ckpt.METRICS}: pympgu writes no file" in err
    finally:
        shutil.rmtree(top)


def test_the_files_of_a_run_are_written_through_its_directory_alone(tmp_path):
    """What a run writes, and how: temporary names made exclusively, replaced into place,
    never a link followed; a writer stopped midway leaves its temporary, which goes."""
    with OutDir(str(tmp_path / "run")) as out:
        out.write_text(ckpt.CONFIG, "{}")
        os.symlink("/etc/passwd", tmp_path / "run" / "link")
        with pytest.raises(OutDirError, match="link is a link: pympgu writes no file"):
            out.open_append("link")
        with pytest.raises(ValueError, match="not a path"):
            out.write_text("../escape", "x")

        def stopped(f):
            f.write(b"half")
            raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            out.write(ckpt.CHECKPOINT, stopped)
        assert sorted(os.listdir(tmp_path / "run")) == [ckpt.CONFIG, "link"]
        open(tmp_path / "run" / f".{ckpt.CHECKPOINT}.0123abcd.tmp", "w").close()
        out.remove_temporaries()
        assert sorted(os.listdir(tmp_path / "run")) == [ckpt.CONFIG, "link"]
