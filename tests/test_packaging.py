"""What `pip install .` puts into the installed package (setuptools' build_py collects it)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_installed_package_carries_the_embedded_dataset(tmp_path):
    # Training falls back on the embedded MNIST test set when no --data-dir is given; an
    # installed pympgu without it could not train offline (session 24 found one).
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
