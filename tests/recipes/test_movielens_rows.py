"""MovieLens rows are validated as Criteo's are: a bad id, rating or timestamp is refused
naming the file, line, column and value, and the recipe reports it as one error line."""

from __future__ import annotations

from pathlib import Path

import pytest

from recpipe.recipes.data import movielens
from recpipe.recipes.data.base import DataFormatError
from recpipe.recipes.data.movielens import MovieLensFormatError, read_ratings

HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
GOOD_ROWS = ["196\t242\t3\t881250949\n", "186\t302\t3\t891717742\n", "22\t377\t1\t878887116\n"]


def _write(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "ml.inter"
    path.write_text(HEADER + "".join(rows))
    return path


def test_good_rows_read_as_their_values(tmp_path: Path) -> None:
    data = read_ratings(_write(tmp_path, GOOD_ROWS))
    assert data["user"].tolist() == [196, 186, 22]
    assert data["item"].tolist() == [242, 302, 377]
    assert data["rating"].tolist() == [3.0, 3.0, 1.0]
    assert data["timestamp"].tolist() == [881250949, 891717742, 878887116]


@pytest.mark.parametrize(
    "row, column, name, value",
    [
        ("196\t242\tnan\t881250949\n", 3, "rating", "nan"),
        ("nan\t242\t3\t881250949\n", 1, "user_id", "nan"),
        ("196\t-5\t3\t881250949\n", 2, "item_id", "-5.0"),
        ("196\t242\t3\tinf\n", 4, "timestamp", "inf"),
        ("944\t242\t3\t881250949\n", 1, "user_id", "944.0"),  # past the release's 943 users
        ("196\t1683\t3\t881250949\n", 2, "item_id", "1683.0"),
        ("196.5\t242\t3\t881250949\n", 1, "user_id", "196.5"),
        ("196\t242\t-inf\t881250949\n", 3, "rating", "-inf"),
        ("196\t242\t-3\t881250949\n", 3, "rating", "-3.0"),  # ratings are 1-5 stars
        ("196\t242\t0\t881250949\n", 3, "rating", "0.0"),
        ("196\t242\t5.5\t881250949\n", 3, "rating", "5.5"),
        ("196\t242\t6\t881250949\n", 3, "rating", "6.0"),
    ],
)
def test_a_bad_value_is_named_with_file_line_column(
    tmp_path: Path, row: str, column: int, name: str, value: str
) -> None:
    path = _write(tmp_path, [GOOD_ROWS[0], row, GOOD_ROWS[1]])
    with pytest.raises(MovieLensFormatError) as e:
        read_ratings(path)
    assert (e.value.path, e.value.line, e.value.column, e.value.value) == (str(path), 3, column, value)
    assert str(e.value).startswith(f"{path}:3: column {column} ({name}) holds {value}, but it must be")
    assert isinstance(e.value, DataFormatError)


def test_a_rating_outside_one_to_five_names_the_allowed_range(tmp_path: Path) -> None:
    path = _write(tmp_path, [GOOD_ROWS[0], "196\t242\t-3\t881250949\n"])
    with pytest.raises(MovieLensFormatError) as e:
        read_ratings(path)
    assert str(e.value).startswith(
        f"{path}:3: column 3 (rating) holds -3.0, but it must be a number in [1, 5] (MovieLens ratings are 1-5 stars)"
    )
    # the range's ends are ratings
    assert read_ratings(_write(tmp_path, ["1\t1\t1\t0\n", "943\t1682\t5\t1\n"]))["rating"].tolist() == [1.0, 5.0]


@pytest.mark.parametrize(
    "bad, what",
    [
        ("196\t242\t3\n", "holds 3 tab-separated column(s) ['196', '242', '3']"),  # short
        ("196\t242\t3\t881250949\t7\n", "holds 5 tab-separated column(s) ['196', '242', '3', '881250949', '7']"),
        ("196 242 3 881250949\n", "holds 1 tab-separated column(s) ['196 242 3 881250949']"),
        ("\n", "is blank"),
        ("   \n", "is blank"),
    ],
)
def test_a_malformed_line_is_named_by_its_editor_line_number(tmp_path: Path, bad: str, what: str) -> None:
    # the header is line 1, so the bad line after two good rows is line 4
    path = _write(tmp_path, [GOOD_ROWS[0], GOOD_ROWS[1], bad, GOOD_ROWS[2]])
    with pytest.raises(MovieLensFormatError) as e:
        read_ratings(path)
    assert (e.value.path, e.value.line) == (str(path), 4)
    assert str(e.value).startswith(
        f"{path}:4: the line {what}, but a row holds 4 tab-separated numbers: user_id (1-943)"
    )
    assert "rating (1-5) and timestamp (Unix seconds)" in str(e.value)


def test_an_empty_cell_or_text_is_named_with_line_and_column(tmp_path: Path) -> None:
    for bad, column, name, cell in (
        ("abc\t242\t3\t881250949\n", 1, "user_id", "abc"),
        ("196\t\t3\t8\n", 2, "item_id", ""),
    ):
        path = _write(tmp_path, [GOOD_ROWS[0], bad])
        with pytest.raises(MovieLensFormatError) as e:
            read_ratings(path)
        assert (e.value.line, e.value.column, e.value.value) == (3, column, cell)
        assert str(e.value).startswith(f"{path}:3: column {column} ({name}) holds {cell!r}, which is not a number")


def test_a_file_without_ratings_is_refused_and_crlf_rows_are_read(tmp_path: Path) -> None:
    with pytest.raises(MovieLensFormatError, match=r"ml\.inter: holds no rating after its header \(line 1\)"):
        read_ratings(_write(tmp_path, []))
    path = tmp_path / "crlf.inter"
    path.write_text(HEADER + "".join(r.replace("\n", "\r\n") for r in GOOD_ROWS))
    assert read_ratings(path)["timestamp"].tolist() == [881250949, 891717742, 878887116]


def test_the_wheels_file_reads_in_full() -> None:
    data = read_ratings(movielens.movielens100k_path())
    assert data["user"].numel() == 100_000 and set(data["rating"].unique().tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}


def test_a_bad_header_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad_header.inter"
    path.write_text("user\titem\n" + GOOD_ROWS[0])
    with pytest.raises(MovieLensFormatError, match=r"bad_header\.inter:1: header"):
        read_ratings(path)


def test_the_recipe_reports_a_bad_row_as_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from recpipe.recipes import train

    path = _write(tmp_path, GOOD_ROWS * 400 + ["196\t242\t3\tinf\n"])
    monkeypatch.setattr(movielens, "movielens100k_path", lambda: path)
    movielens.load_movielens100k.cache_clear()
    try:
        code = train.main(
            ["--max-steps", "2", "--batch-size", "8", "--no-progress-bar", "--tb-dir", str(tmp_path / "tb")]
        )
    finally:
        movielens.load_movielens100k.cache_clear()
    err = capsys.readouterr().err
    assert code == 1
    assert f"MovieLensFormatError: {path}:{len(GOOD_ROWS) * 400 + 2}: column 4 (timestamp) holds inf" in err
    assert "Traceback" not in err
