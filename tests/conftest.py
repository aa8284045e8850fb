"""Fixtures shared by the whole test tree."""

import sys
from typing import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def gloo_worker_pools() -> Iterator[None]:
    """Ends the pooled gloo ranks of ``harness.gloo.run_gloo`` when the session ends, so
    no worker process outlives pytest (an interpreter-exit hook does the same for runs
    outside pytest). A session that never ran a multi-process test imports nothing."""
    yield
    gloo = sys.modules.get("harness.gloo")
    if gloo is not None:
        gloo.shutdown_pools()
