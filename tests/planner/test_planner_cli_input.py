"""The planner CLI's reading of sizes and table YAML.

* a bare size below 1 MiB (``--hbm 80``: a forgotten unit) is refused, naming the flag and
  the fix; explicit bytes (``80B``) and bare numbers of 1 MiB or more are bytes (the same
  plan as with the unit);
* a YAML 1.1 exponent (``rows: 1e6``, a string to PyYAML) is named with the int to write,
  and that int plans.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from recpipe.planner.__main__ import main as cli_main

GiB = 2**30


@pytest.mark.parametrize(
    "flags, flag, value",
    [
        (["--hbm", "80", "--ddr", "1TiB"], "--hbm", "80"),
        (["--hbm", "80GiB", "--ddr", "1024"], "--ddr", "1024"),
        (["--hbm", "0.5", "--ddr", "1TiB"], "--hbm", "0.5"),
    ],
)
def test_cli_refuses_a_size_without_a_unit_below_1_mib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], flag: str, value: str
) -> None:
    """A bare size below 1 MiB (``--hbm 80``, 80 bytes) is refused as a forgotten unit, naming the flag."""
    y = tmp_path / "t.yaml"
    y.write_text("- {name: t, rows: 1000, dim: 8}\n")
    with pytest.raises(SystemExit) as exc:
        cli_main(["--tables", str(y), "--world-size", "2", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"argument {flag}: size '{value}' has no unit, so it means {value} bytes" in err, err
    assert f"write {flag} {value}GiB, or {value}B if you mean bytes" in err, err
    assert "Traceback" not in err and "PlacementPlannerError" not in err


def test_cli_takes_explicit_bytes_and_large_bare_numbers_as_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    y = tmp_path / "t.yaml"
    y.write_text("- {name: t, rows: 1000, dim: 8}\n")
    base = ["--tables", str(y), "--world-size", "2"]
    # explicit bytes: the user meant them (this table does not fit 80 bytes)
    assert cli_main([*base, "--hbm", "80B", "--ddr", "1TiB"]) == 2
    assert "PlacementPlannerError" in capsys.readouterr().err
    # a bare number of 1 MiB or more is bytes, as before: the same plan as with the unit
    assert cli_main([*base, "--hbm", str(GiB), "--ddr", str(2**40), "--json", str(tmp_path / "a.json")]) == 0
    assert cli_main([*base, "--hbm", "1GiB", "--ddr", "1TiB", "--json", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()


@pytest.mark.parametrize(
    "text, key, example", [("rows: 1e6, dim: 8", "rows", "1000000"), ("rows: 1000, dim: 1.6E1", "dim", "16")]
)
def test_cli_names_a_yaml_exponent_that_yaml_reads_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, key: str, example: str
) -> None:
    """``rows: 1e6`` is a string to YAML 1.1; the error said only "got '1e6' (str)"."""
    y = tmp_path / "t.yaml"
    y.write_text(f"- {{name: t, {text}}}\n")
    assert isinstance(yaml.safe_load(y.read_text())[0][key], str)  # the reference: PyYAML's own reading
    assert cli_main(["--tables", str(y), "--world-size", "2", "--hbm", "1GiB", "--ddr", "1TiB"]) == 2
    err = capsys.readouterr().err
    assert f"table #0 (t): {key}: " in err and "is a string to YAML" in err, err
    assert f"e.g. {key}: {example}." in err, err
    # the number the hint writes is read as the int it names and plans
    y.write_text(f"- {{name: t, {text.replace(text.split(key + ': ')[1].split(',')[0], example)}}}\n")
    assert cli_main(["--tables", str(y), "--world-size", "2", "--hbm", "1GiB", "--ddr", "1TiB"]) == 0
