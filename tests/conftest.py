"""Shared test settings: GPU markers skip cleanly without GPUs; every test has a timeout."""
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
