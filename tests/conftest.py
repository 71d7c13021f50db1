"""Hypothesis profiles: "ci" (default, thorough and reproducible) and "dev" (quick local runs).

Select with HYPOTHESIS_PROFILE=dev. torch's thread count is deliberately left as configured by the environment.
Each session compiles into a fresh Inductor cache: AOTAutograd's cache skips a compile (and the backend's
post-AOT passes with it) when an earlier run stored the same graph, so a shared cache would make a test's outcome
depend on what ran before it on this machine.
"""

import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.comera_fx_inductor_cache = tempfile.mkdtemp(prefix="comera_fx_tests_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.comera_fx_inductor_cache


def pytest_unconfigure(config):
    shutil.rmtree(getattr(config, "comera_fx_inductor_cache", ""), ignore_errors=True)


@pytest.fixture(scope="session")
def session_threads() -> int:
    """torch's thread count as the session found it (set up before any module or test fixture)."""
    return torch.get_num_threads()


@pytest.fixture(autouse=True)
def threads_left_as_found(session_threads):
    """A test or fixture that changes torch's thread count must restore it: a leaked ``set_num_threads(1)`` slows
    every later test and changes what they measure. Checked after each test (module fixtures set up during it)."""
    yield
    assert torch.get_num_threads() == session_threads, (
        f"torch's thread count is {torch.get_num_threads()} after this test, {session_threads} before the session: "
        "restore it where it is set"
    )


@pytest.fixture
def one_thread():
    """torch on one thread for the test (a module opts in with ``pytestmark = pytest.mark.usefixtures(...)``): tiny
    GEMMs and SVDs on a busy 2-core machine spend 10-100x longer in OpenMP spin-up than in the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def gemms_narrow_with_rank(monkeypatch):
    """As on a device whose planned products run the two-factor bond at its own rank (no padding floor: CUDA's
    case). There a compaction narrows the GEMMs, so a compiled run still compacts at the last prune point."""
    from comera_fx.tt.plan import autograd

    monkeypatch.setattr(autograd, "PAD_DEVICES", frozenset())
