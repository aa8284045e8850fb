"""README.md checks that can be executed: every command-line flag it documents exists
on the tool it is given to, the planner's dry-run command runs as written, and the
Layout block names the files that exist (every kernel source included)."""

from __future__ import annotations

import argparse
import inspect
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def _options(parser: argparse.ArgumentParser) -> Set[str]:
    return set(parser._option_string_actions)


def _planner_flags() -> Set[str]:
    from recpipe.planner.__main__ import build_parser

    return _options(build_parser())


def _train_flags() -> Set[str]:
    from recpipe.recipes.config import build_arg_parser

    return _options(build_arg_parser())


def _launch_flags() -> Set[str]:
    # the launcher builds its parser inside main(); its --help lists its own flags
    out = subprocess.run([sys.executable, "-m", "recpipe.recipes.launch", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    usage = out.split("\n\n")[0]
    return set(FLAG.findall(usage))


def _torchrun_flags() -> Set[str]:
    from torch.distributed.run import get_args_parser

    return _options(get_args_parser())


def _torchx_run_flags() -> Set[str]:
    from torchx.cli.cmd_run import CmdRun

    parser = argparse.ArgumentParser()
    CmdRun().add_arguments(parser)
    return _options(parser)


def _component_flags(name: str) -> Set[str]:
    """Flags torchx makes of a recpipe component's parameters (``-j``, ``--rdzv_port``)."""
    import recpipe.recipes.components as components

    params = [p for p in inspect.signature(getattr(components, name)).parameters.values()
              if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    return {("-" if len(p.name) == 1 else "--") + p.name for p in params}


def _commands() -> List[str]:
    """Every command line of the README's ``bash`` blocks (continuations joined, comments cut)."""
    lines: List[str] = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def _flags_of(words: List[str]) -> List[str]:
    return [w.split("=")[0] for w in words if FLAG.fullmatch(w.split("=")[0])]


def test_documented_command_lines_use_existing_flags() -> None:
    train = _train_flags()
    checked: Dict[str, int] = {}
    for line in _commands():
        words = shlex.split(line)
        if "recpipe.planner" in words:
            tool, allowed, flags = "planner", _planner_flags(), _flags_of(words[words.index("recpipe.planner"):])
        elif "recpipe.recipes.train" in words:
            at = words.index("-m")
            before, after = words[:at], words[at + 2:]
            if any(w.endswith("torchrun") for w in before):
                unknown = set(_flags_of(before)) - _torchrun_flags()
                assert not unknown, f"torchrun flags {sorted(unknown)} of {line!r} do not exist"
            tool, allowed, flags = "train", train, _flags_of(after)
        elif words[:2] == ["torchx", "run"]:
            sep = words.index("--") if "--" in words else len(words)
            component = next(w for w in words[2:sep] if w.startswith("recpipe."))
            allowed = _torchx_run_flags() | _component_flags(component.split(".", 1)[1])
            unknown = set(_flags_of(words[sep + 1:])) - train
            assert not unknown, f"training flags {sorted(unknown)} of {line!r} do not exist"
            tool, flags = "torchx", _flags_of(words[2:sep])
        else:
            continue  # make, tensorboard: not recpipe's
        unknown = set(flags) - allowed
        assert not unknown, f"{tool} flags {sorted(unknown)} of {line!r} do not exist"
        checked[tool] = checked.get(tool, 0) + 1
    assert set(checked) == {"planner", "train", "torchx"}, checked  # the parsing found the blocks


def test_flags_named_in_the_text_exist() -> None:
    """A flag quoted in the prose (``--checkpoint-dir DIR``) is a flag of one of the command
    lines it documents: the planner, the recipe, the launcher, torchrun, torchx run or a component."""
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    named = {f for span in re.findall(r"`([^`]*)`", prose) for f in FLAG.findall(span) if f.startswith("--")}
    known = (_planner_flags() | _train_flags() | _launch_flags() | _torchx_run_flags() | _torchrun_flags()
             | _component_flags("train") | _component_flags("default_recipe"))
    assert len(named) > 20, named
    assert not named - known, f"README names flags no recpipe command has: {sorted(named - known)}"


def test_planner_dry_run_command_runs_as_written(tmp_path: Path) -> None:
    line = next(c for c in _commands() if "recpipe.planner" in c)
    words = shlex.split(line)
    args = words[words.index("recpipe.planner") + 1:]
    (tmp_path / "tables.yaml").write_text(
        "- {name: user_id, rows: 100000000, dim: 128, dtype: float32, optimizer: adam,\n"
        "   lookups_per_step: 65536, zipf_alpha: 1.1}\n"
    )
    proc = subprocess.run([sys.executable, "-m", "recpipe.planner", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "world_size=16 local_world_size=8" in proc.stdout and "backend=fbgemm" in proc.stdout


def _layout() -> str:
    block = README.split("## Layout", 1)[1]
    return re.search(r"```\n(.*?)```", block, flags=re.S).group(1)  # type: ignore[union-attr]


@pytest.mark.parametrize("folder", ["csrc", "pipeline"])
def test_layout_names_existing_files(folder: str) -> None:
    layout = _layout()
    section = layout.split(f"\n{folder}/", 1)[1]
    section = re.split(r"\n\S", section, maxsplit=1)[0]  # its indented lines
    names = set(re.findall(r"(?<![\w.])(\w+\.(?:py|cpp|cu|h))\b", section))
    assert names, section
    missing = sorted(n for n in names if not (ROOT / folder / n).exists())
    assert not missing, f"Layout names {folder}/ files that do not exist: {missing}"


def test_layout_lists_every_kernel_source() -> None:
    layout = _layout()
    sources = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".cu", ".h"))
    unlisted = [name for name in sources if not re.search(rf"(?m)^\s+{re.escape(name)}\s", layout)]
    assert not unlisted, f"csrc/ files the Layout block does not list: {unlisted}"


def _resolves(dotted: str) -> bool:
    """``recpipe.pipeline.checkpoint.dcp.save`` names an importable module and its attributes."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_named_files_modules_and_ops_exist() -> None:
    paths = set(re.findall(r"(?<![\w/])((?:tests|scripts|csrc|pipeline|planner|recipes|\.ci)/\w[\w./-]*\w)", README))
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not p.endswith("bench_"))  # scripts/bench_*.py
    assert not missing, f"README names files that do not exist: {missing}"
    import recpipe.recipes.components as components
    import torch

    names = set(re.findall(r"(?<![\w.])(recpipe(?:\.\w+)+)", README))
    # `torchx run recpipe.train`: a component of the `recpipe` torchx entry point
    unresolved = sorted(n for n in names if not _resolves(n)
                        and not (n.count(".") == 1 and callable(getattr(components, n.split(".")[1], None))))
    assert len(names) > 10 and not unresolved, f"README names Python objects that do not exist: {unresolved}"
    import recpipe.pipeline  # noqa: F401 - registers the ops

    ops = set(re.findall(r"torch\.ops\.(\w+)\.(\w+)", README))
    assert ("recpipe", "block_bucketize_sparse_features") in ops
    absent = sorted(f"{ns}.{op}" for ns, op in ops if not hasattr(getattr(torch.ops, ns), op))
    assert not absent, f"README names ops that are not registered: {absent}"


def _python_block(section: str) -> str:
    body = README.split(f"\n## {section}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", body, flags=re.S).group(1)  # type: ignore[union-attr]


def test_routing_op_snippet_runs() -> None:
    """The snippet of "The routing op", given the inputs it leaves to the reader."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rows, world_size, seed = 1000, 4, 7
    ns = dict(
        lengths=torch.tensor([2, 3, 0, 1]), indices=torch.tensor([5, 999, 0, 17, 400, 3]),
        block_sizes=torch.tensor([250, 250]), dist_types=torch.tensor([0, 2]), world_size=world_size,
        table_sizes=torch.tensor([rows, rows]), rows=rows, seed=seed,
        kjt=KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([1, 500, 999]),
                                                lengths=torch.tensor([2, 1])),
        ranks=torch.tensor([0, 1, 3]), local_ids=torch.tensor([0, 5, 100]),
    )
    exec(_python_block("The routing op"), ns)  # noqa: S102 - the README's own code
    assert ns["out"].new_lengths.numel() == world_size * 2 * 2  # [W*F*B]
    assert ns["kjt_by_rank"].keys() == ["f"] * world_size
    owner, local = ns["ops"].route_ids(ns["global_ids"], rows, world_size, "hash_roundrobin", seed)
    assert owner.tolist() == [0, 1, 3] and local.tolist() == [0, 5, 100]  # the inverse of routing


def test_placement_planner_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from torchrec.distributed.types import ShardingType
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    model = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=10**6, feature_names=[f"f{i}"])
                for i in range(2)],
        device=torch.device("meta"),
    )
    ns: Dict[str, object] = {"model": model}
    exec(_python_block("Placement planner"), ns)  # noqa: S102 - the README's own code
    assert "world_size=16 local_world_size=8" in capsys.readouterr().out
    params = ns["sharding_plan"].plan[""]  # type: ignore[attr-defined]
    assert {p.sharding_type for p in params.values()} == {ShardingType.ROW_WISE.value}
    assert {p.compute_kernel for p in params.values()} == {"customized_kernel"}


def _dcp_snippet_body(rank: int, world: int, root: str, code: str) -> List[str]:
    import os

    import torch
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from recpipe.pipeline.tiered.sharders import TieredEmbeddingBagCollectionSharder
    from recpipe.planner import PlacementPlanner, make_topology

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100,
                                                            feature_names=["f"])], device=torch.device("cpu"))
    plan = PlacementPlanner(make_topology(world_size=world, local_world_size=world, hbm_cap=2000, ddr_cap=2**20),
                            backend="native").plan(ebc)
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan.to_sharding_plan(),
                                     sharders=[TieredEmbeddingBagCollectionSharder()])  # type: ignore[list-item]
    os.chdir(root)
    exec(code, {"model": model})  # noqa: S102 - the README's own code
    return sorted(os.listdir(os.path.join(root, "ckpt", "step_100")))


def test_dcp_snippet_runs_on_two_ranks(tmp_path: Path) -> None:
    from gloo_harness import run_gloo

    from recpipe.pipeline.checkpoint.dcp import DIGESTS_NAME

    body = README.split("\n### DCP checkpoints\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", body, flags=re.S).group(1)  # type: ignore[union-attr]
    files = run_gloo(2, _dcp_snippet_body, str(tmp_path), code)
    assert files[0] == files[1] and ".metadata" in files[0] and DIGESTS_NAME in files[0]


def test_identifiers_quoted_in_the_text_exist() -> None:
    """Every snake_case name quoted in the prose (`shard_storage`, `local_world_size`) occurs in
    recpipe's sources or in those of the torchrec / fbgemm / torchx it documents."""
    import fbgemm_gpu
    import torchrec
    import torchx

    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    quoted = {name for span in re.findall(r"`([^`\n]+)`", prose)
              for name in re.findall(r"(?<![\w.\-/])([a-z_][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w/])", span)}
    roots = [ROOT / d for d in ("pipeline", "planner", "recipes", "csrc", "scripts", "tests")]
    roots += [Path(m.__file__).parent for m in (torchrec, fbgemm_gpu, torchx)]  # type: ignore[arg-type]
    corpus = "\n".join(p.read_text(errors="ignore") for root in roots for p in root.rglob("*")
                       if p.suffix in (".py", ".cpp", ".h", ".cu", ".yaml") and p.name != "test_readme.py")
    corpus += (ROOT / "setup.py").read_text()
    assert len(quoted) > 30, quoted
    absent = sorted(name for name in quoted if name not in corpus)
    assert not absent, f"README quotes names that occur nowhere in the code: {absent}"
