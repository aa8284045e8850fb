"""Command line and YAML files of ``python -m recpipe.recipes.train``.

One flag per :class:`~recpipe.recipes.config.TrainConfig` field; ``--config FILE.yaml``
(or a packaged config name) supplies values that later flags override. May import
:mod:`recpipe.recipes.config`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.resources
import inspect
import re
import shlex
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from recpipe.recipes.config import (
    FLOAT_RULES,
    OUTPUT_PATHS,
    SUBSETS,
    UNITS,
    ConfigError,
    TrainConfig,
    cli_flag,
    field_choices,
)


def load_yaml(path_or_name: str) -> dict[str, Any]:
    """Field name -> value of a YAML config file or packaged config name (unknown names raise ConfigError)."""
    path = Path(path_or_name)
    if not path.is_file():
        packaged = Path(str(importlib.resources.files("recpipe.recipes") / "configs" / f"{path_or_name}.yaml"))
        if not packaged.is_file():
            raise ConfigError(
                f"config file {path_or_name!r} not found (neither a file nor a packaged config). "
                "Fix: pass an existing YAML path or one of: "
                + ", ".join(sorted(p.stem for p in packaged.parent.glob("*.yaml")))
            )
        path = packaged
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({e}). Fix: pass a readable YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML: {_yaml_problem(e)}. Fix: correct the YAML syntax there"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of field: value")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"config file {str(path)!r} has unknown keys {unknown}. Fix: use only {sorted(known)}")
    return data


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML parse error on one line: what is wrong and where (1-based line and column)."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return " ".join(str(error).split())
    parts = [p for p in (error.context, error.problem) if p]
    where = error.problem_mark or error.context_mark
    at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
    return ", ".join(parts) + at


def _parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def field_docs() -> dict[str, str]:
    """Field name -> its docstring in the :class:`TrainConfig` source (normalised; empty without source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(TrainConfig)))
    except (OSError, TypeError, SyntaxError):
        return {}
    cls = tree.body[0]  # the class statement, decorators included
    if not isinstance(cls, ast.ClassDef):
        return {}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}  # not the InitVar check_paths
    docs: dict[str, str] = {}
    for node, nxt in zip(cls.body, cls.body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id in fields
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            text = " ".join(nxt.value.value.split())
            text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)  # :class:`X` -> X
            docs[node.target.id] = text.replace("``", "")
    return docs


def _show_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class _CommandLineError(Exception):
    """argparse rejected the command line (raised instead of printing and exiting)."""


class _ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise (``--help`` still prints and exits 0)."""

    def error(self, message: str) -> typing.NoReturn:
        raise _CommandLineError(message)


def build_arg_parser() -> argparse.ArgumentParser:
    """The CLI: one flag per TrainConfig field (help: docstring, choices, unit, default) plus ``--config``."""
    parser = _ArgumentParser(
        prog="python -m recpipe.recipes.train",
        allow_abbrev=False,  # "--epoch 3" is an error, not a guess
        description=(
            "Train DLRM / micro-DLRM-DRAM with recpipe (run under torchrun or "
            "'torchx run recpipe.train' for more than one rank). Every flag is a field of "
            "recpipe.recipes.config.TrainConfig; values are checked before training starts."
        ),
        epilog=(
            "--config FILE.yaml (or a packaged name: default) supplies field: value defaults; "
            "flags given on the command line override them."
        ),
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="YAML file of field: value pairs, or a packaged config name (default); later flags override its values",
    )
    hints = typing.get_type_hints(TrainConfig)
    docs = field_docs()
    choices = field_choices()  # the datasets registered now among them
    for f in dataclasses.fields(TrainConfig):
        hint = hints[f.name]
        flag = f"--{cli_flag(f.name)}"
        extras = []
        if f.name in choices:
            extras.append("choices: " + ", ".join(choices[f.name]))
        if f.name in SUBSETS:
            extras.append("a comma-separated subset, any order, of: " + ", ".join(SUBSETS[f.name]))
        if f.name in UNITS:
            extras.append(f"unit: {UNITS[f.name]}")
        if f.name in FLOAT_RULES:
            extras.append(f"range: {FLOAT_RULES[f.name].bounds()}")
        if f.default is not dataclasses.MISSING:
            extras.append(f"default: {_show_default(f.default)}")
        text = docs.get(f.name, "")
        help_text = (f"{text} [{'; '.join(extras)}]" if text else f"[{'; '.join(extras)}]").replace("%", "%%")
        if hint is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        kind: Callable[[str], Any]
        if hint == tuple[int, ...]:
            kind, metavar = _parse_ints, "W1,W2,..."
        elif hint in (int, int | None):
            kind, metavar = int, "N"
        elif hint is float:
            kind, metavar = float, UNITS.get(f.name, "X").upper()
        else:
            kind = str
            metavar = "{" + ",".join(choices[f.name]) + "}" if f.name in choices else "VALUE"
            if f.name in SUBSETS:
                metavar = "TYPE[,TYPE...]"
            if f.name in OUTPUT_PATHS or f.name.endswith("_path"):
                metavar = "PATH"
        parser.add_argument(flag, dest=f.name, type=kind, default=None, metavar=metavar, help=help_text)
    return parser


def parse_config(argv: Sequence[str] | None = None, *, check_paths: bool = True) -> TrainConfig:
    """Builds a validated :class:`TrainConfig` from CLI arguments (``--help`` prints and exits 0).

    Args:
        argv: arguments (default ``sys.argv[1:]``); explicit flags override ``--config`` values.
        check_paths: also check this machine's files and CPUs (see :class:`TrainConfig`).

    Raises:
        ConfigError: a bad command line (quoted) or an invalid value.
    """
    args = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    parser = build_arg_parser()
    try:
        ns = parser.parse_args(args)
    except _CommandLineError as e:
        raise ConfigError(
            f"bad command line {shlex.join(args)!r}: {e}. "
            f"Fix: see '{parser.prog} --help' for the flags and their values"
        ) from None
    values: dict[str, Any] = load_yaml(ns.config) if ns.config else {}
    hints = typing.get_type_hints(TrainConfig)
    for name, value in values.items():
        # YAML 1.1 reads 1e-3 (no dot) as a string: accept it for float fields
        if hints[name] is float and isinstance(value, str):
            try:
                values[name] = float(value)
            except ValueError:
                pass  # TrainConfig reports the field
    values.update({k: v for k, v in vars(ns).items() if v is not None and k != "config"})  # the flags given
    return TrainConfig(**values, check_paths=check_paths)
