"""README.md and docs/ checks that can be executed: the README's Python blocks run as written
(the planner and routing blocks alone; the others given the model and data they leave to the reader,
which examples/ assembles), the README links every example, the docs' Python imports resolve, every command-line
flag they document exists on the tool it is given to, the planner's dry-run command runs, the
Layout block of docs/architecture.md names the files that exist, every relative link points at
an existing file and heading, and every name they quote exists in the code."""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOC_PATHS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "scripts" / "README.md"]
DOCS: Dict[Path, str] = {p: p.read_text() for p in DOC_PATHS}
ALL_TEXT = "\n".join(DOCS.values())
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
README_MAX_LINES = 250
#: README sections whose ```python block a test below runs.
RUN_SECTIONS = {"Pipeline swap", "Placement planner", "Tiered tables (HYBRID / CACHING)", "Routing op", "Checkpoints"}


def _options(parser: argparse.ArgumentParser) -> Set[str]:
    return set(parser._option_string_actions)


def _planner_flags() -> Set[str]:
    from recpipe.planner.__main__ import build_parser

    return _options(build_parser())


def _train_flags() -> Set[str]:
    from recpipe.recipes.cli import build_arg_parser

    return _options(build_arg_parser())


def _launch_flags() -> Set[str]:
    # the launcher builds its parser inside main(); its --help lists its own flags
    out = subprocess.run(
        [sys.executable, "-m", "recpipe.recipes.launch", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
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

    params = [
        p
        for p in inspect.signature(getattr(components, name)).parameters.values()
        if p.kind is not inspect.Parameter.VAR_POSITIONAL
    ]
    return {("-" if len(p.name) == 1 else "--") + p.name for p in params}


def _commands() -> List[str]:
    """Every command line of the ``bash`` blocks (continuations joined, comments cut), README first."""
    lines: List[str] = []
    for text in DOCS.values():
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if line and not line.startswith("#"):
                    lines.append(line)
    return lines


def _flags_of(words: List[str]) -> List[str]:
    return [w.split("=")[0] for w in words if FLAG.fullmatch(w.split("=")[0])]


def _prose(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_readme_is_short() -> None:
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; detail belongs in docs/"


def test_documented_command_lines_use_existing_flags() -> None:
    train = _train_flags()
    checked: Dict[str, int] = {}
    for line in _commands():
        words = shlex.split(line)
        if "recpipe.planner" in words:
            tool, allowed, flags = "planner", _planner_flags(), _flags_of(words[words.index("recpipe.planner") :])
        elif "recpipe.recipes.train" in words:
            at = words.index("-m")
            before, after = words[:at], words[at + 2 :]
            if any(w.endswith("torchrun") for w in before):
                unknown = set(_flags_of(before)) - _torchrun_flags()
                assert not unknown, f"torchrun flags {sorted(unknown)} of {line!r} do not exist"
            tool, allowed, flags = "train", train, _flags_of(after)
        elif words[:2] == ["torchx", "run"]:
            sep = words.index("--") if "--" in words else len(words)
            component = next(w for w in words[2:sep] if w.startswith("recpipe."))
            allowed = _torchx_run_flags() | _component_flags(component.split(".", 1)[1])
            unknown = set(_flags_of(words[sep + 1 :])) - train
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
    named = {f for span in re.findall(r"`([^`]*)`", _prose(ALL_TEXT)) for f in FLAG.findall(span) if f.startswith("--")}
    known = (
        _planner_flags()
        | _train_flags()
        | _launch_flags()
        | _torchx_run_flags()
        | _torchrun_flags()
        | _component_flags("train")
        | _component_flags("default_recipe")
    )
    assert len(named) > 20, named
    assert not named - known, f"docs name flags no recpipe command has: {sorted(named - known)}"


def test_planner_dry_run_command_runs_as_written(tmp_path: Path) -> None:
    line = next(c for c in _commands() if "recpipe.planner" in c)  # the README's
    words = shlex.split(line)
    args = words[words.index("recpipe.planner") + 1 :]
    (tmp_path / "tables.yaml").write_text(
        "- {name: user_id, rows: 100000000, dim: 128, dtype: float32, optimizer: adam,\n"
        "   lookups_per_step: 65536, zipf_alpha: 1.1}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "recpipe.planner", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "world_size=16 local_world_size=8" in proc.stdout and "backend=fbgemm" in proc.stdout


def _layout() -> str:
    block = (ROOT / "docs" / "architecture.md").read_text().split("## Layout", 1)[1]
    return re.search(r"```\n(.*?)```", block, flags=re.S).group(1)  # type: ignore[union-attr]


def _layout_entries(folder: str) -> List[str]:
    """The first word of each line indented by two spaces under ``folder/`` in the Layout block
    (deeper lines continue an entry's description)."""
    section = _layout().split(f"\n{folder}/", 1)[1]
    section = re.split(r"\n\S", section, maxsplit=1)[0]
    return re.findall(r"(?m)^  (\S+)", section)


@pytest.mark.parametrize("folder", ["csrc", "pipeline"])
def test_layout_names_existing_files(folder: str) -> None:
    entries = _layout_entries(folder)
    assert entries, folder
    missing = sorted(e for e in entries if not (ROOT / folder / e).exists())
    assert not missing, f"Layout names {folder}/ entries that do not exist: {missing}"


def test_layout_lists_every_kernel_source_and_pipeline_subpackage() -> None:
    sources = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".cu", ".h"))
    unlisted = sorted(set(sources) - set(_layout_entries("csrc")))
    assert not unlisted, f"csrc/ files the Layout block does not list: {unlisted}"
    packages = sorted(p.name + "/" for p in (ROOT / "pipeline").iterdir() if (p / "__init__.py").exists())
    unlisted = sorted(set(packages) - set(_layout_entries("pipeline")))
    assert not unlisted, f"pipeline/ subpackages the Layout block does not list: {unlisted}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve() -> None:
    """Every relative link of README.md, docs/*.md and scripts/README.md names an existing file
    (and, with ``#anchor``, one of its headings)."""
    links = 0
    for path, text in DOCS.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            links += 1
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor:
                slugs = {_slug(h) for h in re.findall(r"(?m)^#+ (.*)$", _prose(dest.read_text()))}
                assert anchor in slugs, f"{path.relative_to(ROOT)} links to {target}: no such heading"
    assert links > 20, links
    readme_links = set(re.findall(r"\]\((docs/\w+\.md)", README))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= readme_links, f"docs pages the README does not link: {sorted(pages - readme_links)}"


def test_package_roots_export_what_they_map() -> None:
    """Every lazy export of ``recpipe.pipeline`` and ``recpipe.pipeline.checkpoint`` (the roots
    the README imports from) resolves, and classes and functions come from the module named."""
    import importlib

    for root in ("recpipe.pipeline", "recpipe.pipeline.checkpoint"):
        package = importlib.import_module(root)
        for name, module in package._EXPORTS.items():
            obj = getattr(package, name)
            assert obj is getattr(importlib.import_module(module), name), (root, name)
            defined = getattr(obj, "__module__", module) if inspect.isclass(obj) or inspect.isfunction(obj) else module
            assert defined == module, f"{root}.{name} maps to {module}, but is defined in {defined}"


def _resolves(dotted: str) -> bool:
    """``recpipe.pipeline.checkpoint.save`` names an importable module and its attributes."""
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
    paths = set(
        re.findall(r"(?<![\w/.])((?:tests|scripts|csrc|pipeline|planner|recipes|examples|\.ci)/\w[\w./-]*\w)", ALL_TEXT)
    )
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs name files that do not exist: {missing}"
    import torch

    import recpipe.recipes.components as components

    names = set(re.findall(r"(?<![\w.])(recpipe(?:\.\w+)+)", ALL_TEXT))
    # `torchx run recpipe.train`: a component of the `recpipe` torchx entry point
    unresolved = sorted(
        n
        for n in names
        if not _resolves(n) and not (n.count(".") == 1 and callable(getattr(components, n.split(".")[1], None)))
    )
    assert len(names) > 10 and not unresolved, f"docs name Python objects that do not exist: {unresolved}"
    import recpipe.pipeline.routing.ops  # noqa: F401 - registers the ops

    ops = set(re.findall(r"torch\.ops\.(\w+)\.(\w+)", ALL_TEXT))
    assert ("recpipe", "block_bucketize_sparse_features") in ops
    absent = sorted(f"{ns}.{op}" for ns, op in ops if not hasattr(getattr(torch.ops, ns), op))
    assert not absent, f"docs name ops that are not registered: {absent}"


def test_identifiers_quoted_in_the_text_exist() -> None:
    """Every snake_case name quoted in the prose (`shard_storage`, `local_world_size`) occurs in
    recpipe's sources or in those of the torchrec / fbgemm / torchx it documents."""
    import fbgemm_gpu
    import torchrec
    import torchx

    quoted = {
        name
        for span in re.findall(r"`([^`\n]+)`", _prose(ALL_TEXT))
        for name in re.findall(r"(?<![\w.\-/])([a-z_][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w/])", span)
    }
    roots = [ROOT / d for d in ("pipeline", "planner", "recipes", "csrc", "scripts", "tests", "examples")]
    roots += [Path(m.__file__).parent for m in (torchrec, fbgemm_gpu, torchx)]  # type: ignore[arg-type]
    corpus = "\n".join(
        p.read_text(errors="ignore")
        for root in roots
        for p in root.rglob("*")
        if p.suffix in (".py", ".cpp", ".h", ".cu", ".yaml") and p.name != "test_readme.py"
    )
    corpus += (ROOT / "setup.py").read_text()
    assert len(quoted) > 30, quoted
    absent = sorted(name for name in quoted if name not in corpus)
    assert not absent, f"docs quote names that occur nowhere in the code: {absent}"


# --- the Python blocks -------------------------------------------------------------------------


def _python_blocks(text: str) -> List[Tuple[str, str]]:
    """(the ``##`` section it sits in, code) of every ```python block of ``text``."""
    blocks: List[Tuple[str, str]] = []
    for part in re.split(r"(?m)^## ", text)[1:]:
        title = part.split("\n", 1)[0].strip()
        blocks += [(title, code) for code in re.findall(r"```python\n(.*?)```", part, flags=re.S)]
    return blocks


def _python_block(section: str) -> str:
    (code,) = [code for title, code in _python_blocks(README) if title == section]
    return code


def test_every_readme_python_block_is_run() -> None:
    """A README section gaining a ```python block needs a test here that runs it."""
    assert {title for title, _ in _python_blocks(README)} == RUN_SECTIONS


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_docs_python_blocks_parse_and_import(page: str) -> None:
    """The docs' Python blocks are valid Python and every name they import exists."""
    import importlib

    for _, code in _python_blocks((ROOT / "docs" / page).read_text()):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert _resolves(f"{node.module}.{alias.name}") or hasattr(module, alias.name), (
                        f"docs/{page} imports {alias.name} from {node.module}, which has no such name"
                    )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)


def test_readme_links_every_example() -> None:
    examples = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert examples and examples <= set(re.findall(r"\]\(examples/([\w.]+\.py)\)", README)), examples


def test_routing_op_snippet_runs_alone() -> None:
    """The "Routing op" block defines its own inputs; its ids land on the ranks a pure-Python routing
    names, and the inverse gives them back."""
    from harness.routing_reference import RefPermutation

    ns: Dict[str, Any] = {}
    exec(_python_block("Routing op"), ns)  # noqa: S102 - the README's own code
    world, rows, seed, ids = ns["W"], ns["rows"], ns["seed"], ns["indices"].tolist()
    owner = {i: RefPermutation(rows, seed).forward(i) % world for i in ids}
    assert ns["out"].new_lengths.numel() == world * 1 * 2  # [W*F*B]: one feature, two bags
    assert ns["global_ids"].tolist() == [i for rank in range(world) for i in ids if owner[i] == rank]
    assert ns["kjt_by_rank"].keys() == ["f"] * world
    assert ns["kjt_by_rank"].lengths().tolist() == ns["out"].new_lengths.tolist()


def test_placement_planner_snippet_runs_alone(capsys: pytest.CaptureFixture[str]) -> None:
    from torchrec.distributed.types import ShardingType

    ns: Dict[str, object] = {}
    exec(_python_block("Placement planner"), ns)  # noqa: S102 - the README's own code
    assert "world_size=16 local_world_size=8" in capsys.readouterr().out
    params = ns["sharding_plan"].plan[""]  # type: ignore[attr-defined]
    # two 1M-row tables fit any rank's 80 GiB whole: each is torchrec's FUSED table on one rank,
    # which moves W times fewer pooled bytes than row-wise
    assert {p.sharding_type for p in params.values()} == {ShardingType.TABLE_WISE.value}
    assert {p.compute_kernel for p in params.values()} == {"fused"}
    assert sorted(p.ranks[0] for p in params.values()) == [0, 1]  # type: ignore[index]


def _pipeline_snippet_body(rank: int, world: int, code: str) -> Tuple[List[float], float]:
    import torch
    from harness.pipelines import build_dmp, make_batches, run_reference

    device = torch.device("cpu")
    batches = make_batches(rank)
    reference, ref_opt = build_dmp("table_wise", device)
    ref_losses, _ = run_reference(reference, ref_opt, batches)
    model, optimizer = build_dmp("table_wise", device)
    ns = {"model": model, "optimizer": optimizer, "device": device, "batches": batches}
    exec(code, ns)  # noqa: S102 - the README's own code
    loss, _ = ns["output"]  # the harness model's output: (loss, logits)
    return [float(x) for x in ref_losses], float(loss)


def test_pipeline_swap_snippet_runs() -> None:
    """The "Pipeline swap" loop trains to the non-pipelined loop's last loss, bit for bit."""
    from harness.gloo import run_gloo

    ((ref_losses, last_loss),) = run_gloo(1, _pipeline_snippet_body, _python_block("Pipeline swap"))
    assert last_loss == ref_losses[-1]


def _tiered_checkpoint_body(rank: int, world: int, root: str, tiered: str, ckpt: str) -> Tuple[str, List[str]]:
    import contextlib
    import io
    import os

    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])],
        device=torch.device("cpu"),
    )
    ns = {"ebc": ebc}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(tiered, ns)  # noqa: S102 - the README's own code
    os.chdir(root)
    exec(ckpt, {"model": ns["model"]})  # noqa: S102 - the README's own code
    mode = ns["plan"].placement("t").mode.value  # type: ignore[attr-defined]
    return f"{mode} {out.getvalue()}", sorted(os.listdir(os.path.join(root, "ckpt", "step_100")))


def test_tiered_and_checkpoint_snippets_run_on_two_ranks(tmp_path: Path) -> None:
    """The "Tiered tables" block shards a pinned CACHING table; "Checkpoints" saves, verifies
    and loads it (DCP files plus the digest record)."""
    from harness.gloo import run_gloo

    from recpipe.pipeline.checkpoint import DIGESTS_NAME

    results = run_gloo(
        2,
        _tiered_checkpoint_body,
        str(tmp_path),
        _python_block("Tiered tables (HYBRID / CACHING)"),
        _python_block("Checkpoints"),
    )
    (stats0, files0), (_, files1) = results
    assert stats0.lower().startswith("caching") and "'t'" in stats0
    assert files0 == files1 and ".metadata" in files0 and DIGESTS_NAME in files0
