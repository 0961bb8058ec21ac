"""Shared test settings and fixtures: GPU markers skip cleanly without GPUs, every test has a
timeout, a random test prints its seed when it fails, and CPU JAX runs in fresh processes."""
import concurrent.futures
import importlib
import multiprocessing as mp
import os

import pytest

import pympgu


def visible_gpus():
    """GPUs usable here, capped by PYMPGU_TEST_GPUS (e.g. 1 to test on fewer)."""
    n = pympgu.cuda.device_count()
    cap = os.environ.get("PYMPGU_TEST_GPUS")
    return min(n, int(cap)) if cap else n


def pytest_collection_modifyitems(config, items):
    n = visible_gpus()
    for item in items:
        if "gpu" in item.keywords and n == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU: "
                                             + str(pympgu.cuda_unavailable_reason())))
        mark = item.get_closest_marker("multi_gpu")
        if mark is not None and n < mark.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {mark.args[0]} GPUs, {n} visible"))


@pytest.fixture(autouse=True)
def _messages():
    """pympgu's messages on stderr, as its commands show them (pympgu.log.setup), at the
    level of a command without -q or -v whatever the test before chose."""
    from pympgu.log import setup
    setup()


@pytest.fixture
def pympgu_env(monkeypatch):
    """Set PYMPGU_* variables for this test, as ``pympgu_env(split_max_ranks=4)``: pympgu's
    settings are read again, here and in the workers the test starts."""
    from pympgu import settings

    def setenv(**values):
        for name, value in values.items():
            monkeypatch.setenv(settings.Settings.variable(name), str(value))
        settings.reload()
    yield setenv
    settings.reload()  # read at the next use, once monkeypatch has undone the variables


@pytest.fixture
def seed(request):
    """A fresh seed for this test's random inputs, printed if the test fails
    (PYMPGU_TEST_SEED=N replays a failure with its seed)."""
    value = int(os.environ.get("PYMPGU_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(("seed", f"this test's seed was {value}: "
                                                f"PYMPGU_TEST_SEED={value} replays it"))


def _choose_platform(platform):
    os.environ["JAX_PLATFORMS"] = platform
    os.environ["PYTHONWARNINGS"] = "ignore"


def _call(module, name, args):
    return getattr(importlib.import_module(module), name)(*args)


@pytest.fixture
def jax_process():
    """``jax_process(name, *args, platform="cpu")``: tests/jax_programs.py's function
    ``name`` called in a fresh process whose JAX computes on ``platform`` ('cpu' or 'cuda';
    JAX chooses it when first imported, and the test process may hold a GPU's context);
    returns what the function returns, raises what it raises."""
    def run(name, *args, platform="cpu", timeout=500):
        with concurrent.futures.ProcessPoolExecutor(
                1, mp_context=mp.get_context("spawn"), initializer=_choose_platform,
                initargs=(platform,)) as pool:
            return pool.submit(_call, "jax_programs", name, args).result(timeout)
    return run
