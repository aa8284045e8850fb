"""The installed package: layout, import names, the extension and its CUDA part."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import recpipe._C
import recpipe.pipeline
import recpipe.planner
import recpipe.recipes

REPO = Path(__file__).resolve().parent.parent


def test_namespace_package_has_the_three_subpackages() -> None:
    import recpipe

    assert not hasattr(recpipe, "__file__") or recpipe.__file__ is None  # PEP 420 namespace
    # each subpackage is a regular package in one of the namespace's portions
    # (the installed recpipe/ or the dev overlay's), not a module found elsewhere on sys.path
    portions = {Path(p) for p in recpipe.__path__}
    for name, mod in (("pipeline", recpipe.pipeline), ("planner", recpipe.planner), ("recipes", recpipe.recipes)):
        init = Path(mod.__file__)
        assert init.name == "__init__.py" and init.parent.name == name, init
        assert init.parent.parent in portions, (init, sorted(portions))


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI checks the installed (non-editable) package")
def test_tests_import_the_installed_package_not_the_sources() -> None:
    for mod in (recpipe.pipeline, recpipe.planner, recpipe.recipes, recpipe._C):
        path = Path(mod.__file__).resolve()
        assert "site-packages" in path.parts, path
        for src in ("pipeline", "planner", "recipes", "csrc", "build"):
            assert REPO / src not in path.parents, path


def test_ops_are_registered_with_cpu_and_fake_kernels() -> None:
    import recpipe.pipeline.routing.ops  # noqa: F401  (registers the fake kernels)
    from recpipe.planner import knapsack

    assert knapsack._cpp_ops() is not None  # loads the planner kernels, registers their fakes
    for name in (
        "block_bucketize_sparse_features",
        "hash_roundrobin_global_ids",
        "placement_dp",
        "placement_budget_prices",
        "placement_prune_dominated",
    ):
        qual = f"recpipe::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "Meta")


def _cuda_toolkit_present() -> bool:
    return shutil.which("nvcc") is not None or any(Path("/usr/local").glob("cuda-*/bin/nvcc"))


@pytest.mark.skipif(
    torch.version.cuda is None or not _cuda_toolkit_present() or os.environ.get("RECPIPE_CUDA") == "0",
    reason="CPU-only torch or no nvcc: the CUDA kernels are not built",
)
def test_cuda_kernels_compiled_linked_and_registered() -> None:
    """With nvcc and a CUDA torch, setup.py must build the .cu and register it."""
    for name in ("block_bucketize_sparse_features", "hash_roundrobin_global_ids"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"recpipe::{name}", "CUDA"), name
