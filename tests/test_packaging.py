"""What `pip install .` puts into the installed package, and the used-by line."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_installed_package_carries_the_embedded_dataset(tmp_path):
    # Training falls back on the embedded MNIST test set when no --data-dir is given; an
    # installed pympgu without it could not train offline.
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Package would be ignored" not in r.stderr, r.stderr[-3000:]
    built = tmp_path / "pympgu"
    embedded = sorted((ROOT / "pympgu" / "datasets").iterdir())
    assert any(f.name.endswith("images-idx3-ubyte.gz") for f in embedded)
    for f in embedded:
        assert (built / "datasets" / f.name).read_bytes() == f.read_bytes(), f.name
    for f in [*ROOT.glob("pympgu/*.py"), *ROOT.glob("pympgu/*.pyx"), *ROOT.glob("pympgu/*.pxd")]:
        assert (built / f.name).is_file(), f.name


def test_source_distribution_carries_the_cuda_sources(tmp_path):
    # setuptools puts into an sdist only the sources it is given as an Extension's; the
    # kernels (csrc/*.cu) and headers come through MANIFEST.in, or a wheel built from the
    # sdist would have no CUDA module.
    src = clean_copy(tmp_path)
    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                       cwd=src, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    (tarball,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(tarball) as t:
        packed = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    needed = [n for n in listed.stdout.splitlines()
              if n.startswith(("csrc/", "pympgu/", "examples/"))
              or n in ("build.sh", "requirements.txt")]
    assert any(n.endswith(".cu") for n in needed)
    missing = [n for n in needed if n not in packed]
    assert not missing, missing


def test_build_sh_says_what_it_built_in_one_line_and_shows_the_log_on_failure(tmp_path):
    src = clean_copy(tmp_path)
    env = dict(os.environ, PYMPGU_NO_CUDA="1")
    r = subprocess.run(["bash", "build.sh"], cwd=src, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.splitlines() == [r.stdout.strip()] and not r.stderr, r.stdout + r.stderr
    assert r.stdout.startswith("pympgu: built pympgu._host only (PYMPGU_NO_CUDA=1) in ")
    assert r.stdout.strip().endswith("log: build/build.log")
    assert "building 'pympgu._host' extension" in (src / "build" / "build.log").read_text()
    broken = src / "csrc" / "host_average.cpp"
    broken.write_text("this is not C++\n")
    later = os.stat(broken).st_mtime + 5  # setuptools compares whole seconds
    os.utime(broken, (later, later))
    r = subprocess.run(["bash", "build.sh"], cwd=src, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1
    assert "host_average.cpp" in r.stdout and "error" in r.stdout.lower(), r.stdout[-3000:]
    assert "pympgu: the build failed; its whole log: build/build.log" in r.stderr


def clean_copy(tmp_path):
    """The tracked files alone, as a fresh clone has them: nothing built."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    src = tmp_path / "src"
    for name in listed.stdout.splitlines():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    return src


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_install_then_train_from_the_repository_root(tmp_path):
    """The used-by line: in a fresh virtual environment, `pip install .` (an isolated build),
    then `python -m pympgu.train` from the repository's root, whose own tree is not built:
    CPU workers train, and --gpus without a GPU is a flag error, not an ImportError. Where a
    CUDA toolkit is found, the isolated build fetched jaxlib and compiled the XLA operations
    in. The environment sees the system's packages, so that the run's dependencies need no
    download; pympgu itself is built as pip builds it anywhere."""
    src = clean_copy(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = dict(os.environ, PYMPGU_CUDA_ARCH="90")  # one architecture: a quicker build
    r = subprocess.run([python, "-m", "pip", "install", "-q", str(src)], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    trained = subprocess.run([python, "-m", "pympgu.train", "--cpu", "2", "--epochs", "1",
                              "--quiet"], cwd=src, capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "epoch   1  loss" in trained.stdout, trained.stdout
    gpus = subprocess.run([python, "-m", "pympgu.train", "--gpus", "0", "1"], cwd=src,
                          capture_output=True, text=True, timeout=120)
    if gpus.returncode == 2:  # no GPU here, as on CI
        assert "--gpus: no usable GPU here" in gpus.stderr, gpus.stderr
        assert "--cpu N" in gpus.stderr and "Traceback" not in gpus.stderr, gpus.stderr
    if shutil.which("nvcc"):
        built = subprocess.run([python, "-c", "from pympgu import _cuda; import pympgu; "
                                "print(pympgu.__file__, _cuda.xla_handler() is not None)"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr[-3000:]
        where, xla = built.stdout.split()
        assert str(venv) in where and xla == "True", built.stdout
