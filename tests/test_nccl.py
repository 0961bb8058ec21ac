"""pympgu's NCCL loader (csrc/nccl.cc): it finds NCCL where JAX or PyTorch put it, or
refuses with the reason and the fix. Stand-in libraries built here play NCCL's part, each
in a fresh process (a process loads NCCL once)."""
import json
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pympgu._cuda", reason="pympgu was built without CUDA")

STAND_IN = r"""
#include <string.h>
typedef struct { char internal[128]; } id_t;
int ncclGetVersion(int *v) { *v = VERSION; return 0; }
int ncclGetUniqueId(id_t *id) { memset(id->internal, 'p', 128); return UID_STATUS; }
int ncclCommInitRankConfig(void **c, int n, id_t id, int r, void *cfg) { return 4; }
int ncclCommGetAsyncError(void *c, int *e) { *e = 0; return 0; }
#ifndef WITHOUT_ABORT
int ncclCommAbort(void *c) { return 0; }
#endif
int ncclCommFinalize(void *c) { return 0; }
int ncclCommDestroy(void *c) { return 0; }
int ncclAllReduce(const void *s, void *r, unsigned long n, int t, int op, void *c, void *st) {
  return 0;
}
const char *ncclGetErrorString(int r) { return "stand-in error string"; }
const char *ncclGetLastError(void *c) { return "stand-in last error"; }
"""


def stand_in(tmp_path, version=22306, without_abort=False, uid_status=0):
    """A library with NCCL's symbols (ncclCommInitRankConfig always fails; ncclGetUniqueId
    returns ``uid_status``)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src, lib = tmp_path / "nccl.c", tmp_path / "libnccl.so.2"
    src.write_text(STAND_IN)
    flags = [f"-DVERSION={version}", f"-DUID_STATUS={uid_status}"] + (
        ["-DWITHOUT_ABORT"] if without_abort else [])
    subprocess.run([cc, "-shared", "-fPIC", *flags, "-o", str(lib), str(src)], check=True)
    return str(lib)


def fresh(code):
    """Run ``code`` (which prints one JSON value) in a fresh interpreter; its value."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_error(path):
    return fresh(f"""
        import json
        from pympgu import cuda
        try:
            cuda.nccl_load({path!r})
            print(json.dumps(None))
        except cuda.CudaError as e:
            print(json.dumps([e.name, e.message]))
    """)


def test_a_missing_nccl_is_refused_naming_the_place_and_the_fix(tmp_path):
    path = str(tmp_path / "nowhere" / "libnccl.so.2")
    name, message = load_error(path)
    assert name == "pmgErrorNcclMissing"
    assert path in message and "No such file" in message
    assert "NCCL 2.14 or later" in message and "pip install nvidia-nccl-cu13" in message


def test_an_nccl_without_abort_is_refused(tmp_path):
    name, message = load_error(stand_in(tmp_path, without_abort=True))
    assert name == "pmgErrorNcclMissing" and "it has no ncclCommAbort" in message


def test_an_nccl_too_old_is_refused(tmp_path):
    name, message = load_error(stand_in(tmp_path, version=21304))
    assert "it is version 21304, and pympgu needs 21400 or later" in message


def test_the_candidates_start_with_the_wheel_and_end_with_the_system(tmp_path):
    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
    found = fresh(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from pympgu import cuda
        print(json.dumps(cuda.nccl_candidates()))
    """)
    assert found[0] == str(lib / "libnccl.so.2") and found[-1] == "libnccl.so.2"


def test_an_nccl_that_loads_gives_its_version_and_ids(tmp_path):
    got = fresh(f"""
        import json
        from pympgu import cuda
        first = cuda.nccl_load({stand_in(tmp_path)!r})
        again = cuda.nccl_load("/not/there")  # loaded already: nothing to do
        uid = cuda.nccl_unique_id()
        print(json.dumps([first == again, cuda.nccl_version(), uid.decode(), len(uid)]))
    """)
    assert got == [True, 22306, "p" * 128, 128]


def test_an_nccl_failure_is_a_cuda_error_with_nccls_name_and_message(tmp_path):
    got = fresh(f"""
        import json
        from pympgu import cuda
        cuda.nccl_load({stand_in(tmp_path, uid_status=2)!r})
        try:
            cuda.nccl_unique_id()
        except cuda.CudaError as e:
            print(json.dumps([e.status, e.name, e.message]))
    """)
    assert got == [20002, "ncclSystemError", "stand-in error string"]


@pytest.mark.parametrize("options,match", [
    (dict(wire_dtype="bfloat16"), "no low-precision wire"),
    (dict(method="copy"), "not by the copy method"),
    (dict(shadow=True), "no shadow"),
    (dict(method="nccl", shadow=True), "the nccl method takes no shadow")])
def test_the_gpu_exchange_across_nodes_refuses_what_it_cannot_do(options, match):
    """Before it touches a GPU: the hierarchy averages float32 by the kernels."""
    from types import SimpleNamespace

    from pympgu.exchange import Exchanger
    ctx = SimpleNamespace(is_cpu=False, nnodes=2, rank=0, nranks=2, local_rank=0,
                          local_nranks=1, node=0, device=0)
    with pytest.raises(ValueError, match=match):
        Exchanger(ctx, [("w", [4, 4], "float32")], **options)


def test_inside_xla_the_nccl_road_is_named_by_a_kernel_algorithm_without_a_shadow():
    from types import SimpleNamespace

    from pympgu.xla import StepExchange
    ex = SimpleNamespace(method="auto", backend=SimpleNamespace(across=object()))
    assert StepExchange(ex).algo == "twoshot"
    ex.backend.across = None
    assert StepExchange(ex).algo == "auto"


@pytest.mark.parametrize("flags,flag", [(["--nnodes", "2", "--node-rank", "0", "--coordinator",
                                          "127.0.0.1:29400"], "--nnodes"),
                                        (["--method", "nccl"], "--method nccl")])
def test_a_gpu_run_that_needs_nccl_is_refused_before_any_worker_where_none_loads(
        tmp_path, flags, flag):
    """Told as a flag error, with every place tried: GPUs are pretended (this machine may
    have none), NCCL is a stand-in without ncclCommAbort."""
    lib = stand_in(tmp_path, without_abort=True)
    wheel = tmp_path / "site" / "nvidia" / "nccl" / "lib"
    wheel.mkdir(parents=True)
    shutil.copy(lib, wheel / "libnccl.so.2")
    err = fresh(f"""
        import json, os, sys
        sys.path.insert(0, {str(tmp_path / "site")!r})
        os.environ["PYMPGU_SECRET"] = "a secret long enough for the nodes of this test"
        from pympgu import cuda
        from pympgu.training import cli
        cuda.availability = lambda: (True, 2)
        cli._check_jax_for_gpus = lambda parser: None
        sys.stderr = open({str(tmp_path / "err")!r}, "w")
        try:
            cli.main(["--gpus", "0", "1"] + {flags!r})
        except SystemExit as e:
            sys.stderr.close()
            print(json.dumps([e.code, open({str(tmp_path / "err")!r}).read()]))
    """)
    assert err[0] == 2, err
    assert f"{flag}: pmgErrorNcclMissing" in err[1], err
    assert "NCCL 2.14 or later is needed between nodes" in err[1], err
    assert "libnccl.so.2: it has no ncclCommAbort" in err[1], err
