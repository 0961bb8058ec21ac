"""Build pympgu: Cython modules, plus csrc/*.cu compiled by nvcc when a CUDA toolkit is found.

The toolkit is looked for in CUDA_HOME (or CUDA_PATH), next to the nvcc on PATH, then in
/usr/local/cuda. Without one, only the host module is built and pympgu.cuda_available()
says why. PYMPGU_NO_CUDA=1 forces that host-only build; PYMPGU_CUDA_ARCH="80;90" picks the
real architectures (PTX for the highest is always embedded so newer GPUs can JIT it).

With jaxlib's XLA FFI headers the extension also holds pympgu's XLA operations (the
exchange inside a training step's jitted call); PYMPGU_NO_XLA=1 leaves them out.

This file is also the build backend that pyproject.toml names: setuptools' own, which adds
jaxlib to the isolated build's requirements where a CUDA toolkit is found, so that ``pip
install .`` compiles the XLA operations in (docs/DECISIONS.md, "Installing JAX").
"""
import ctypes
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
JAX_MIN = "0.4.30"


def find_cuda():
    """The toolkit root (with headers and libcudart_static), or None."""
    if os.environ.get("PYMPGU_NO_CUDA") == "1":
        return None
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if not home:
            continue
        has_header = os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h"))
        if has_header and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home
    return None


def cuda_major(home):
    """The toolkit's CUDA major version (12, 13), from cuda_runtime_api.h, or None."""
    try:
        with open(os.path.join(home, "include", "cuda_runtime_api.h")) as f:
            found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", f.read())
    except OSError:
        return None
    return int(found.group(1)) // 1000 if found else None


def has_driver():
    """Whether an NVIDIA driver is installed here (its libcuda loads)."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def jax_requirement():
    """The JAX that training needs here: with CUDA where a driver and the toolkit pympgu
    is built with are found (JAX's CUDA plugin of the toolkit's major version), plain JAX
    (CPU) elsewhere, so that CPU-only installs stay light."""
    home = find_cuda()
    major = cuda_major(home) if home else None
    if major in (12, 13) and has_driver():
        return f"jax[cuda{major}]>={JAX_MIN}"
    return f"jax>={JAX_MIN}"


def cuda_libdir(home):
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
        if os.path.exists(os.path.join(home, sub, "libcudart_static.a")):
            return os.path.join(home, sub)
    raise RuntimeError(f"CUDA toolkit at {home} has no libcudart_static.a")


def find_xla_ffi():
    """jaxlib's include directory when it holds the XLA FFI headers, else None."""
    if os.environ.get("PYMPGU_NO_XLA") == "1":
        return None
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = os.path.join(list(spec.submodule_search_locations)[0], "include")
    return include if os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")) else None


def gencode_flags():
    archs = os.environ.get("PYMPGU_CUDA_ARCH", "80;90").replace(",", ";").split(";")
    archs = sorted({a.strip() for a in archs if a.strip()}, key=int)
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    top = archs[-1]
    flags += ["-gencode", f"arch=compute_{top},code=compute_{top}"]
    return flags


def _newer(src, obj):
    deps = [src] + glob.glob(os.path.join(CSRC, "*.h")) + glob.glob(os.path.join(CSRC, "*.cuh"))
    return max(os.path.getmtime(d) for d in deps) > os.path.getmtime(obj)


def extensions():
    from Cython.Build import cythonize
    from setuptools import Extension
    cxx = ["-O3", "-std=c++17"]
    exts = [
        Extension("pympgu._host", ["pympgu/_host.pyx", f"{CSRC}/host_average.cpp",
                                   f"{CSRC}/host_barrier.cpp", f"{CSRC}/host_threads.cpp"],
                  include_dirs=[CSRC], language="c++", extra_compile_args=cxx,
                  extra_link_args=["-pthread"]),
    ]
    home = find_cuda()
    if home is None:
        why = ("PYMPGU_NO_CUDA=1" if os.environ.get("PYMPGU_NO_CUDA") == "1" else
               "no CUDA toolkit found")
        print(f"pympgu: {why}; building the host part only", file=sys.stderr)
    else:
        include_dirs = [CSRC, os.path.join(home, "include")]
        macros = [("PMG_WITH_CUDA", "1")]
        flags = list(cxx)
        xla = find_xla_ffi()
        if xla:
            flags += ["-isystem", xla]  # its headers' own warnings are not ours
            macros.append(("PMG_WITH_XLA_FFI", "1"))
        else:
            print("pympgu: jaxlib's FFI headers not found; building without the XLA operations",
                  file=sys.stderr)
        ext = Extension(
            "pympgu._cuda._core",
            ["pympgu/_cuda/_core.pyx", f"{CSRC}/host_average.cpp", f"{CSRC}/host_threads.cpp",
             f"{CSRC}/xla_ffi.cc", f"{CSRC}/nccl.cc"],
            include_dirs=include_dirs, language="c++",
            define_macros=macros, extra_compile_args=flags,
            library_dirs=[cuda_libdir(home)],
            # The static runtime: the module then loads on machines with a driver but no
            # toolkit, and on machines with neither it imports and reports the missing driver.
            libraries=["cudart_static", "rt", "pthread", "dl"],
        )
        exts.append(ext)
    return cythonize(exts, compiler_directives={"language_level": "3"}, quiet=True)


def build_ext_class():
    from setuptools.command.build_ext import build_ext

    class BuildExt(build_ext):
        """Compiles the CUDA sources with nvcc and links them into pympgu._cuda._core."""

        def build_extension(self, ext):
            # cythonize() copies the Extension objects, so the CUDA one is recognised by name.
            cuda_home = find_cuda() if ext.name == "pympgu._cuda._core" else None
            if cuda_home:
                ext.extra_objects = self.compile_cuda(os.path.join(cuda_home, "bin", "nvcc"))
            super().build_extension(ext)

        def compile_cuda(self, nvcc):
            """The object of each csrc/*.cu, compiled where it is out of date: one nvcc a
            core at once (a kernel file's two architectures take tens of seconds)."""
            from concurrent.futures import ThreadPoolExecutor
            os.makedirs(self.build_temp, exist_ok=True)
            objects, commands = [], []
            for src in sorted(glob.glob(os.path.join(CSRC, "*.cu"))):
                obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
                if self.force or not os.path.exists(obj) or _newer(src, obj):
                    commands.append([nvcc, "-O3", "-std=c++17", "-DPMG_WITH_CUDA", "-Xcompiler",
                                     "-fPIC", "-I", CSRC, *gencode_flags(), "-c", src, "-o", obj])
                objects.append(obj)
            for cmd in commands:
                print(" ".join(cmd), flush=True)
            with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                for done in pool.map(lambda cmd: subprocess.run(cmd, capture_output=True,
                                                                text=True), commands):
                    print(done.stdout + done.stderr, end="", flush=True)
                    if done.returncode:
                        raise subprocess.CalledProcessError(done.returncode, done.args)
            return objects

    return BuildExt


# ---------------------------------------------------------------- the build backend

def _backend():
    from setuptools import build_meta
    return build_meta


def _build_requires():
    """jaxlib, for its XLA FFI headers, where the CUDA extension will be built."""
    if find_cuda() is None or os.environ.get("PYMPGU_NO_XLA") == "1":
        return []
    return [f"jaxlib>={JAX_MIN}"]


def get_requires_for_build_wheel(config_settings=None):
    return _backend().get_requires_for_build_wheel(config_settings) + _build_requires()


def get_requires_for_build_editable(config_settings=None):
    return _backend().get_requires_for_build_editable(config_settings) + _build_requires()


def get_requires_for_build_sdist(config_settings=None):
    return _backend().get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _backend().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _backend().prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _backend().build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _backend().build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _backend().build_sdist(sdist_directory, config_settings)


if __name__ == "__main__":
    from setuptools import setup
    setup(ext_modules=extensions(), cmdclass={"build_ext": build_ext_class()},
          install_requires=["numpy>=1.24", "pyzmq>=25", "pytensor>=2.20", "matplotlib>=3.5",
                            jax_requirement()])
