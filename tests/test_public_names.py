"""Names say one thing each: no two source modules (or a module and a package) of recpipe share a
name, and no public name of recpipe is a torchrec name with another interface.

torchrec's names are read statically (``ast``) from the installed torchrec package: every public
top-level class and function of its non-test modules. A recpipe public name (what
``recpipe.pipeline``, ``recpipe.planner`` and ``recpipe.pipeline.checkpoint`` export) may share one
only where it is the same interface, listed in :data:`SAME_INTERFACE` with the reason.
"""

from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set

import pytest
import torchrec

REPO = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("pipeline", "planner", "recipes")
PUBLIC_PACKAGES = ("recpipe.pipeline", "recpipe.planner", "recpipe.pipeline.checkpoint")

#: recpipe public names that torchrec also defines, each the same interface as torchrec's.
SAME_INTERFACE: Dict[str, str] = {
    # a drop-in: takes torchrec's own constructor arguments (emb_lookup_stream,
    # embedding_lookup_after_data_dist) with torchrec's meaning, and its progress / reset API
    "TrainPipelineFusedSparseDist": "torchrec.distributed.train_pipeline.TrainPipelineFusedSparseDist",
    # torchrec's constructor arguments in torchrec's order (start_batch, stash_gradients, strict, ...),
    # its staleness (tables last updated at B-2), progress / is_semi_sync / reset; recpipe's own
    # arguments are keyword-only additions
    "TrainPipelineSemiSync": "torchrec.distributed.train_pipeline.TrainPipelineSemiSync",
    # fbgemm's op's interface (every argument); torchrec's name is an experimental TPU dispatcher
    "block_bucketize_sparse_features": "fbgemm_gpu's torch.ops.fbgemm.block_bucketize_sparse_features",
}


def module_names() -> Dict[str, List[str]]:
    """Basename -> the source modules and packages of pipeline/, planner/ and recipes/ so named."""
    names: Dict[str, List[str]] = defaultdict(list)
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if path.name == "__init__.py":
                if path.parent != REPO / folder:
                    names[path.parent.name].append(rel.rpartition("/")[0] + "/")
            elif path.name != "__main__.py":
                names[path.stem].append(rel)
    return names


def torchrec_public_names() -> Set[str]:
    """Every public top-level class and function name of torchrec's non-test modules."""
    root = Path(torchrec.__file__).resolve().parent
    out: Set[str] = set()
    for path in root.rglob("*.py"):
        if "test" in path.name or "tests" in path.parts or "test_utils" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        out.update(
            node.name
            for node in tree.body
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_")
        )
    return out


def recpipe_public_names() -> Dict[str, str]:
    """Public name -> the recpipe package that exports it."""
    out: Dict[str, str] = {}
    for package in PUBLIC_PACKAGES:
        for name in importlib.import_module(package).__all__:
            out.setdefault(name, package)
    return out


def test_no_two_source_modules_share_a_name() -> None:
    """Pins one name per concept: ``routing/sharders.py`` beside ``tiered/sharders.py`` or the
    ``routing/`` package beside ``tiered/routing.py`` would each fail here."""
    names = module_names()
    assert len(names) > 60  # every module was read
    shared = {name: where for name, where in names.items() if len(where) > 1}
    assert shared == {}


def test_module_name_check_sees_packages_and_modules() -> None:
    """The check above counts a package and a module of the same name as a clash."""
    names = module_names()
    assert names["routing"] == ["pipeline/routing/"]
    assert names["fused_pipeline"] == ["pipeline/train_pipeline/fused_pipeline.py"]


def test_no_public_name_is_a_torchrec_name_with_another_interface() -> None:
    """Pins that a reader of recpipe beside torchrec never meets one name for two interfaces."""
    theirs = torchrec_public_names()
    assert {"TrainPipelineSparseDist", "EmbeddingBagCollectionSharder", "PlannerError"} <= theirs
    ours = recpipe_public_names()
    assert "PlacementPlanner" in ours and "TrainPipelineFusedSparseDist" in ours
    clashes = sorted(name for name in ours if name in theirs and name not in SAME_INTERFACE)
    assert clashes == []


@pytest.mark.parametrize("name", sorted(SAME_INTERFACE))
def test_same_interface_names_are_exported(name: str) -> None:
    """Every allowed shared name is still a recpipe public name (the allowance is not stale)."""
    assert name in recpipe_public_names()
