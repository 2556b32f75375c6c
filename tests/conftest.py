"""The shared multi-process fixture and the suite-wide hypothesis profile (no per-example deadline).

A module defines `_worker(rank, world) -> dict` (plain data), and optionally `WORLD` (ranks,
default 2) and `SPAWN_TIMEOUT_S` (default 120); its tests take the `results` fixture (one dict
per rank). Every test using it gets a hard timeout of SPAWN_TIMEOUT_S + 30 s unless it has its own.
`launch()` starts ranks from a fork server (DUPLEXPIPE_START_METHOD=forkserver) unless a test says
otherwise (test_launch checks the default, spawn). Property tests run without hypothesis' 200 ms
per-example deadline and its too-slow health check: both fail on a loaded machine, and no test may
depend on wall-clock speed.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from models import run_workers

from duplexpipe.launch.processes import START_METHOD_ENV
from duplexpipe.planner.calibration_cache import CACHE_ENV

settings.register_profile("duplexpipe", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("duplexpipe")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # 2 cores: inductor compiles in-process, no worker pool
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")  # the vector ISA from /proc/cpuinfo: no test builds
os.environ.setdefault(START_METHOD_ENV, "forkserver")  # launch() forks ranks from one server: seconds per spawn
if CACHE_ENV not in os.environ:  # schedule="auto"'s calibration cache: set before any rank starts (a fork server
    # keeps the environment it started with), never the user's ~/.cache; removed when the session ends
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="duplexpipe-test-cache-")
    atexit.register(shutil.rmtree, os.environ[CACHE_ENV], ignore_errors=True)

DEFAULT_WORLD = 2
DEFAULT_SPAWN_TIMEOUT_S = 120


def _spawn_timeout(module: Any) -> float:
    return float(getattr(module, "SPAWN_TIMEOUT_S", DEFAULT_SPAWN_TIMEOUT_S))


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Each rank's result of the module's `_worker`, from one spawn shared by the module's tests."""
    module = request.module
    worker = getattr(module, "_worker", None)
    if worker is None:
        raise RuntimeError(f"{module.__name__} uses the `results` fixture but defines no _worker(rank, world)")
    return run_workers(worker, int(getattr(module, "WORLD", DEFAULT_WORLD)), timeout_s=_spawn_timeout(module))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A hard timeout for every test that waits on the shared spawn."""
    for item in items:
        if "results" in getattr(item, "fixturenames", ()) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(_spawn_timeout(getattr(item, "module", None)) + 30))
