"""What `pip install .` puts into the installed package (setuptools' build_py collects it)."""
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
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    src = tmp_path / "src"
    for name in listed.stdout.splitlines():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                       cwd=src, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    (tarball,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(tarball) as t:
        packed = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    needed = [n for n in listed.stdout.splitlines()
              if n.startswith(("csrc/", "pympgu/", "examples/"))
              or n in ("build.sh", "requirements.txt")]
    assert any(n.endswith(".cu") for n in needed)
    missing = [n for n in needed if n not in packed]
    assert not missing, missing
