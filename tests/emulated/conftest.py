"""The fixtures of the emulated kernel tests (test_emulated_kernels.py, test_emulated_mla.py): the driver programs,
built once per session, and the runs each test's cases take."""

import pytest
from test_emulated_kernels import BUILDS, EMULATED, FLAGS, RUNS, SOURCES, SWEEP_RUNS, Driver
from test_emulator import build_programs


@pytest.fixture(scope="session")
def programs():
    """build name -> the driver program (rebuilt when a kernel header, the emulator or the driver changes)."""
    return build_programs("kernels", EMULATED / "kernels.cpp", BUILDS, FLAGS, SOURCES)


@pytest.fixture
def driver(programs, request):
    """The driver programs, with the runs this test's cases take: RUNS for a test without parameters or the first
    case of a parametrized one, one of SWEEP_RUNS for its other cases."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or not any(callspec.indices.values()):
        return Driver(programs, RUNS)
    return Driver(programs, SWEEP_RUNS[sum(callspec.indices.values()) % 2], sweep=True)
