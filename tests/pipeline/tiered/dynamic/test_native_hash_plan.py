"""The native kernel's key-index plan equals the torch plan (itself checked against the pure-Python reference
in ``test_dynamic_shard.py``), passes ``opcheck`` and refuses bad input naming the argument."""

from __future__ import annotations

import pytest
import torch

from recpipe.pipeline.tiered.dynamic.native_plan import native_hash_plan
from recpipe.pipeline.tiered.dynamic.plan import torch_hash_plan


def _state(slots: int, n: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-(2**62), 2**62, (slots,), generator=g)
    scores = torch.randint(0, 5, (slots,), generator=g)
    sizes = torch.randint(0, 17, (slots // 16,), generator=g)
    held = keys[torch.randint(0, slots, (n // 2,), generator=g)]
    uniq = torch.unique(
        torch.cat([held, torch.randint(-(2**62), 2**62, (n // 2,), generator=g), torch.tensor([0, -1])])
    )
    want = torch.rand(uniq.numel(), generator=g) < 0.8
    return uniq, want, keys, scores, sizes


@pytest.mark.parametrize("slots,n", [(16, 40), (64, 30), (1024, 500), (1 << 16, 8192)])
@pytest.mark.parametrize("salt", [0, 12345, 2**64 - 1])
def test_native_plan_equals_the_torch_plan(slots: int, n: int, salt: int) -> None:
    uniq, want, keys, scores, sizes = _state(slots, n, slots + n)
    for w in (want, None):
        got = native_hash_plan(uniq, w, keys, scores, sizes, 16, salt)
        ref = torch_hash_plan(uniq, w, keys, scores, sizes, 16, salt)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_opcheck_and_fake_shapes() -> None:
    uniq, want, keys, scores, sizes = _state(64, 30, 1)
    args = (uniq, want, keys, scores, sizes, 16, 77)
    torch.library.opcheck(torch.ops.recpipe.dynamic_hash_plan.default, args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
        found, slot = torch.ops.recpipe.dynamic_hash_plan(*fake)
    assert found.shape == slot.shape == uniq.shape and found.dtype == torch.int64


def test_bad_input_names_the_argument() -> None:
    uniq, want, keys, scores, sizes = _state(64, 30, 2)
    with pytest.raises((ValueError, RuntimeError), match="uniq"):
        native_hash_plan(uniq.to(torch.int32), want, keys, scores, sizes, 16, 0)
    with pytest.raises((ValueError, RuntimeError), match="sizes|keys"):
        native_hash_plan(uniq, want, keys, scores, sizes[:-1], 16, 0)


@pytest.mark.parametrize("dim", [1, 7, 64])
def test_native_uniform_rows_equal_the_torch_formula(dim: int) -> None:
    """The compiled uniform initializer computes the torch implementation's doubles (checked against the
    pure-Python reference in test_dynamic_shard.py), cast to float32, bit for bit."""
    from recpipe.pipeline.placement import DynamicInitializer
    from recpipe.pipeline.tiered.dynamic.key_hashing import _uniforms, init_salt, to_int64_bits
    from recpipe.pipeline.tiered.dynamic.native_plan import native_init_uniform

    keys = torch.cat([torch.randint(-(2**63), 2**63 - 1, (300,)), torch.tensor([0, -1, 2**63 - 1, -(2**63)])])
    salt = init_salt(9, "table")
    lo, hi = DynamicInitializer().bounds(1000)
    want = (lo + (hi - lo) * _uniforms(keys, salt, dim)).to(torch.float32)
    assert torch.equal(native_init_uniform(keys, dim, salt, lo, hi), want)
    torch.library.opcheck(torch.ops.recpipe.dynamic_init_uniform.default, (keys, dim, to_int64_bits(salt), lo, hi))
