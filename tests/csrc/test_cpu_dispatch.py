"""The CPU dispatch compiled into recpipe._C (csrc/cpu_dispatch.h) and its guards.

On x86-64 the kernels choose AVX-512 / AVX2 / baseline x86-64 per call; a build
with RECPIPE_PORTABLE=1 (``make test-portable``), or any non-x86 CPU, compiles
the portable paths only. The op tests of tests/csrc/ compare both builds'
kernels with pure-Python references, so both give the same results; these tests
pin that the extension under test is the build that was asked for, that the
portable build refuses the x86 ISAs by name, and that every x86-only construct
in csrc/ sits behind the one guard macro (so aarch64 builds compile).
"""

from __future__ import annotations

import os
import platform
import random
import re
from pathlib import Path

import pytest
import torch
from harness.routing_reference import ref_bucketize

import recpipe._C
from recpipe.pipeline.routing import ops

CSRC = Path(__file__).resolve().parents[2] / "csrc"
GUARD = "RECPIPE_X86_DISPATCH"
# Code that compiles only for x86: target attributes, CPU feature probes, the
# intrinsics headers, their vector types and intrinsics, cpuid / rdtsc.
X86_ONLY = re.compile(
    r"__attribute__\s*\(\(\s*target\s*\(|__builtin_cpu_(?:supports|is|init)|<\w*intrin\.h>|\b_mm\d*_\w+"
    r"|\b__m(?:64|128|256|512)\w*|\bcpuid|__rdtsc|__builtin_ia32_"
)
# Target macros: only cpu_dispatch.h decides from them.
X86_MACROS = re.compile(r"\b(?:__x86_64__|__i386__|_M_X64|_M_IX86|__AVX\w*__|__SSE\w*__|__BMI\w*__|__FMA__)\b")


def _portable_requested() -> bool:
    """Whether this run's extension should be portable: RECPIPE_PORTABLE in the env, or a non-x86 CPU."""
    flag = os.environ.get("RECPIPE_PORTABLE", "0").strip().lower()
    return flag in ("1", "true", "on", "yes") or platform.machine().lower() not in ("x86_64", "amd64")


def test_extension_reports_the_requested_dispatch() -> None:
    want = "portable" if _portable_requested() else "x86"
    assert recpipe._C.CPU_DISPATCH == want, (
        f"{recpipe._C.__file__} was built with the {recpipe._C.CPU_DISPATCH!r} dispatch, but this run asks for "
        f"{want!r} (RECPIPE_PORTABLE={os.environ.get('RECPIPE_PORTABLE')!r}, machine {platform.machine()!r}); "
        "put the matching build first on PYTHONPATH (make test-portable builds build/portable)."
    )


def _hash_case(rng: random.Random, W: int) -> dict:
    """Two hash_roundrobin features (tables of 1000 and 2^33 rows) and one continuous feature."""
    table_sizes, B = [1000, 2**33, 5000], 40
    lengths = [rng.randrange(60) for _ in range(len(table_sizes) * B)]
    indices = [rng.randrange(table_sizes[k // B]) for k, ln in enumerate(lengths) for _ in range(ln)]
    return dict(
        lengths=lengths,
        indices=indices,
        block_sizes=[-(-n // W) for n in table_sizes],
        dist_types=[2, 2, 0],
        table_sizes=table_sizes,
        W=W,
    )


def _bucketize(case: dict, seed: int) -> tuple[list[int], list[int]]:
    got = ops.block_bucketize_sparse_features(
        torch.tensor(case["lengths"]),
        torch.tensor(case["indices"]),
        torch.tensor(case["block_sizes"]),
        torch.tensor(case["dist_types"]),
        case["W"],
        table_sizes=torch.tensor(case["table_sizes"]),
        seed=seed,
    )
    return got.new_lengths.tolist(), got.new_indices.tolist()


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_portable_build_refuses_x86_isas_by_name(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if recpipe._C.CPU_DISPATCH != "portable":
        pytest.skip("the x86 dispatch build runs RECPIPE_ISA=avx2/avx512 (test_block_bucketize_op.py's isa fixture)")
    monkeypatch.setenv("RECPIPE_ISA", isa)
    with pytest.raises(RuntimeError, match=rf"RECPIPE_ISA={isa} but this build is portable .* pick baseline"):
        _bucketize(_hash_case(random.Random(0), 4), seed=1)


@pytest.mark.parametrize("isa", ["", "auto", "baseline"])
def test_every_build_hashes_like_the_reference_under_each_accepted_isa(
    isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RECPIPE_ISA", isa)
    rng = random.Random(7)
    for W in (1, 3, 8):
        case = _hash_case(rng, W)
        seed = rng.randrange(2**63)
        want = ref_bucketize(
            case["lengths"],
            case["indices"],
            case["block_sizes"],
            case["dist_types"],
            W,
            table_sizes=case["table_sizes"],
            seed=seed,
            index_bits=64,
        )
        assert _bucketize(case, seed) == (want["new_lengths"], want["new_indices"])


def _unguarded(text: str) -> list[tuple[int, str]]:
    """(line, code) of each x86-only construct outside `#if defined(RECPIPE_X86_DISPATCH)` branches."""
    stack: list[bool] = []  # per open #if: whether the current branch is the guard's positive one
    found: list[tuple[int, str]] = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("//", 1)[0].strip()
        directive = re.match(r"#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)", line)
        if directive:
            kind, cond = directive.group(1), directive.group(2).strip()
            positive = kind in ("if", "ifdef") and cond in (f"defined({GUARD})", GUARD)
            if kind in ("if", "ifdef", "ifndef"):
                stack.append(positive)
            elif kind in ("elif", "else") and stack:
                stack[-1] = False
            elif kind == "endif" and stack:
                stack.pop()
        if X86_ONLY.search(line) and not any(stack):
            found.append((no, raw.strip()))
    return found


def test_x86_only_code_in_csrc_sits_behind_the_dispatch_guard() -> None:
    sources = sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h", ".cu", ".cuh"))
    assert any(p.name == "bucketize.cpp" for p in sources), f"csrc/ not found at {CSRC}"
    bad = {p.name: _unguarded(p.read_text()) for p in sources}
    assert not {k: v for k, v in bad.items() if v}, (
        f"x86-only code outside `#if defined({GUARD})` (csrc/cpu_dispatch.h); guard it beside a portable path: {bad}"
    )
    raw_macros = {p.name: X86_MACROS.findall(p.read_text()) for p in sources if p.name != "cpu_dispatch.h"}
    assert not {k: v for k, v in raw_macros.items() if v}, (
        f"only csrc/cpu_dispatch.h tests x86 target macros (use {GUARD}): {raw_macros}"
    )


def test_guard_scan_flags_unguarded_and_accepts_guarded_code() -> None:
    code = (
        '#include "cpu_dispatch.h"\n'
        "#if defined(RECPIPE_X86_DISPATCH)\n#include <immintrin.h>\n"
        '__attribute__((target("avx2"))) void f() {}\n#else\nvoid f() {}\n#endif\n'
        'bool g() { return __builtin_cpu_supports("avx2"); }\n'
        "#if defined(__x86_64__)\n__m256d h();\n#endif\n"
    )
    assert [no for no, _ in _unguarded(code)] == [8, 10]
