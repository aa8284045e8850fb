"""``recpipe::dynamic_unique`` (the native index's deduplication of a batch's keys) returns what a pure-Python
dedupe (sorted distinct keys, each position's index among them, each key's repeats) and ``torch.unique`` return,
over the whole int64 range; passes ``opcheck``; its fake kernel gives the shapes; bad input names the argument."""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

from recpipe.pipeline.tiered.dynamic.key_index import torch_unique
from recpipe.pipeline.tiered.dynamic.native_plan import native_unique

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _reference(keys: List[int]) -> Tuple[List[int], List[int], List[int]]:
    uniq = sorted(set(keys))
    at = {k: i for i, k in enumerate(uniq)}
    counts = [0] * len(uniq)
    for k in keys:
        counts[at[k]] += 1
    return uniq, [at[k] for k in keys], counts


def _keys(case: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if case == "full_range":  # raw keys: every bit pattern, negatives included
        return torch.randint(INT64_MIN, INT64_MAX, (n,), generator=gen, dtype=torch.int64)
    if case == "repeats":  # few distinct keys, many repeats (a Zipf-like batch)
        pool = torch.randint(INT64_MIN, INT64_MAX, (max(n // 16, 1),), generator=gen, dtype=torch.int64)
        return pool[torch.randint(0, pool.numel(), (n,), generator=gen)]
    if case == "small_ids":  # keys sharing their high digits (the radix passes skipped)
        return torch.randint(-300, 300, (n,), generator=gen, dtype=torch.int64)
    assert case == "extremes"
    base = torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 1, INT64_MIN + 1, INT64_MAX - 1], dtype=torch.int64)
    return base[torch.randint(0, base.numel(), (n,), generator=gen)]


@pytest.mark.parametrize("case", ["full_range", "repeats", "small_ids", "extremes"])
@pytest.mark.parametrize("n", [1, 2, 17, 5000])
def test_native_unique_equals_a_python_dedupe_and_torch_unique(case: str, n: int) -> None:
    keys = _keys(case, n, seed=n)
    got = native_unique(keys)
    uniq, inverse, counts = _reference(keys.tolist())
    assert got[0].tolist() == uniq
    assert got[1].tolist() == inverse
    assert got[2].tolist() == counts
    for a, b in zip(got, torch_unique(keys)):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)


def test_native_unique_of_no_keys_is_empty() -> None:
    uniq, inverse, counts = native_unique(torch.empty(0, dtype=torch.int64))
    assert uniq.numel() == inverse.numel() == counts.numel() == 0


def test_native_unique_reads_a_strided_view() -> None:
    keys = _keys("repeats", 400, seed=3)
    view = keys[::2]
    assert not view.is_contiguous()
    for a, b in zip(native_unique(view), torch_unique(view.contiguous())):
        assert torch.equal(a, b)


def test_opcheck_and_fake_shapes() -> None:
    keys = _keys("repeats", 300, seed=1)
    torch.library.opcheck(torch.ops.recpipe.dynamic_unique.default, (keys,))
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        uniq, inverse, counts = torch.ops.recpipe.dynamic_unique(mode.from_tensor(keys))
    assert inverse.shape == keys.shape and uniq.dtype == counts.dtype == torch.int64
    assert uniq.shape == counts.shape and uniq.dim() == 1


@pytest.mark.parametrize(
    "keys, named", [(torch.zeros(4, dtype=torch.int32), "int64"), (torch.zeros(2, 2, dtype=torch.int64), "1-D")]
)
def test_bad_input_names_the_argument(keys: torch.Tensor, named: str) -> None:
    with pytest.raises(RuntimeError, match=f"`keys` must be {named}"):
        native_unique(keys)
