"""Strict Criteo TSV parsing: valid files parse exactly, every bad row names file:line.

Criteo rows are a 0/1 label, 13 decimal integers and 26 categorical ids written as
32-bit hex. Refused: ids ``int(v, 16)`` would accept (``-1a``, ``0x1a``, ``1_a``, wider
than 32 bits) and integers past int64 (a 45-digit one would be ``inf`` in the dense
features).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from recpipe.recipes.config import TrainConfig
from recpipe.recipes.data.criteo import COLUMN_NAMES, CriteoFormatError, parse_criteo_row, read_criteo_rows
from recpipe.recipes.data.registry import make_data_source

INT_MAX = 2**63 - 1
INT_MIN = -(2**63)


def _reference(line: str) -> tuple[int, list[int], list[int]]:
    """The values a valid row must give: Python's own int parsing of each cell."""
    cols = line.split("\t")
    return (int(cols[0]), [int(v) if v else 0 for v in cols[1:14]], [int(v, 16) if v else 0 for v in cols[14:]])


def _random_valid_line(rng: random.Random) -> str:
    ints = []
    for _ in range(13):
        r = rng.random()
        if r < 0.1:
            ints.append("")
        elif r < 0.15:
            ints.append(str(rng.choice([INT_MAX, INT_MIN, 10**18, -(10**18), 2**62])))  # 19 digits
        else:
            ints.append(str(rng.randint(-3, 10 ** rng.randint(0, 17))))
    cats = []
    for _ in range(26):
        r = rng.random()
        if r < 0.1:
            cats.append("")
        elif r < 0.15:
            cats.append(rng.choice(["ffffffff", "FFFFFFFF", "0", "00000000ff", "0000000000000001"]))
        else:
            v = "%x" % rng.randrange(2**32)
            cats.append(v.upper() if rng.random() < 0.2 else v.rjust(8, "0"))
    return "\t".join([str(rng.randint(0, 1)), *ints, *cats])


def _good_line(i: int = 0) -> str:
    return "\t".join([str(i % 2)] + [str(i + k) for k in range(13)] + ["%08x" % (i * 7919 + k) for k in range(26)])


def test_valid_rows_parse_exactly(tmp_path: Path) -> None:
    rng = random.Random(7)
    lines = [_random_valid_line(rng) for _ in range(3000)]
    crlf = tmp_path / "crlf.tsv"
    crlf.write_bytes(("\r\n".join(lines[:100]) + "\r\n").encode())
    plain = tmp_path / "plain.tsv"
    plain.write_text("\n".join(lines[100:]))  # the last line has no newline
    rows = list(read_criteo_rows([str(crlf), str(plain)]))
    assert rows == [_reference(line) for line in lines]
    # the whole-row fast path and the per-field parser agree
    assert rows == [parse_criteo_row(line.split("\t")) for line in lines]


def _cell(column_name: str) -> int:
    return COLUMN_NAMES.index(column_name)


@pytest.mark.parametrize(
    "column, value, why",
    [
        ("cat_5", "-1a", "not a hexadecimal id"),
        ("cat_0", "0x1a", "not a hexadecimal id"),
        ("cat_25", "1_a", "not a hexadecimal id"),
        ("cat_3", " 1a", "not a hexadecimal id"),
        ("cat_3", "nothex!!", "not a hexadecimal id"),
        ("cat_7", "1ffffffff", "wider than 32 bits"),
        ("cat_7", "100000000", "wider than 32 bits"),
        ("int_2", "1" + "0" * 44, "45 digits do not fit in 64 bits"),
        ("int_0", str(2**63), "do not fit in 64 bits"),
        ("int_12", str(-(2**63) - 1), "do not fit in 64 bits"),
        ("int_4", "1.5", "not a decimal integer"),
        ("int_4", "+5", "not a decimal integer"),
        ("int_4", "nan", "not a decimal integer"),
        ("int_4", "inf", "not a decimal integer"),
        ("int_4", "\u0663", "not a decimal integer"),  # ARABIC-INDIC DIGIT THREE: int() takes it
        ("label", "2", "label must be 0 or 1"),
        ("label", "", "label must be 0 or 1"),
        ("label", " 1", "label must be 0 or 1"),
    ],
)
def test_bad_value_names_file_line_column_and_value(tmp_path: Path, column: str, value: str, why: str) -> None:
    cols = _good_line(3).split("\t")
    cols[_cell(column)] = value
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join([_good_line(i) for i in range(3)] + ["\t".join(cols)] + [_good_line(5)]) + "\n")
    with pytest.raises(CriteoFormatError) as e:
        list(read_criteo_rows([str(path)]))
    message = str(e.value)
    assert message.startswith(f"{path}:4: column {_cell(column) + 1} ({column}) has a malformed value {value!r}")
    assert why in message and "Fix:" in message
    assert (e.value.path, e.value.line, e.value.column, e.value.value) == (str(path), 4, _cell(column) + 1, value)


@pytest.mark.parametrize(
    "bad_line, why",
    [
        ("\t".join(["1"] * 39), "row has 39 columns, expected 40"),
        ("\t".join(["1"] * 41), "row has 41 columns, expected 40"),
        ("", "blank line"),
        (" ".join(_good_line(1).split("\t")), "row has 1 columns"),  # spaces instead of tabs
    ],
)
def test_bad_row_shape_names_file_and_line(tmp_path: Path, bad_line: str, why: str) -> None:
    first, second = tmp_path / "a.tsv", tmp_path / "b.tsv"
    first.write_text("\n".join(_good_line(i) for i in range(4)) + "\n")
    second.write_text("\n".join([_good_line(0), _good_line(1), bad_line, _good_line(2)]) + "\n")
    with pytest.raises(CriteoFormatError) as e:
        list(read_criteo_rows([str(first), str(second)]))
    assert str(e.value).startswith(f"{second}:3: ")  # lines count per file
    assert why in str(e.value)
    assert (e.value.path, e.value.line, e.value.column) == (str(second), 3, None)


def test_non_ascii_bytes_are_reported_not_decoded_away(tmp_path: Path) -> None:
    cols = [c.encode() for c in _good_line(1).split("\t")]
    cols[_cell("cat_9")] = b"1a\xff"
    path = tmp_path / "x.tsv"
    path.write_bytes(_good_line(0).encode() + b"\n" + b"\t".join(cols) + b"\n")
    with pytest.raises(CriteoFormatError, match=r"x\.tsv:2: column 24 \(cat_9\) has a malformed value '1a\\\\xff'"):
        list(read_criteo_rows([str(path)]))


def test_data_source_fails_at_parse_time_instead_of_training_on_inf(tmp_path: Path) -> None:
    path = tmp_path / "day_0.tsv"
    cols = _good_line(2).split("\t")
    cols[_cell("int_6")] = "9" * 45
    lines = [_good_line(i) for i in range(12)]
    lines[7] = "\t".join(cols)
    path.write_text("\n".join(lines) + "\n")
    cfg = TrainConfig(
        dataset="criteo_tsv",
        data_path=str(path),
        model="dlrm",
        batch_size=2,
        num_embeddings=97,
        embedding_dim=8,
        dense_arch=(8,),
        over_arch=(8, 1),
    )
    src = make_data_source(cfg, 0, 2)
    batches = src.train_batches(0, 3)
    first = next(batches)  # rows 1-4 are valid
    assert torch.isfinite(first.dense_features).all()
    with pytest.raises(CriteoFormatError, match=r"day_0\.tsv:8: column 8 \(int_6\) .*45 digits"):
        next(batches)
    # the same row under the old parsing: float32 inf, so log1p(inf) and a NaN loss later
    assert math.isinf(torch.tensor([float(int("9" * 45))], dtype=torch.float32).item())
