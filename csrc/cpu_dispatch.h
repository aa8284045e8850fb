// recpipe: which CPU dispatch this build compiles, decided in one place.
//
// RECPIPE_X86_DISPATCH is defined on x86-64 unless the build defines
// RECPIPE_PORTABLE (setup.py adds -DRECPIPE_PORTABLE=1 when RECPIPE_PORTABLE=1
// is in its environment). Every x86-only construct of csrc/ (target attributes,
// __builtin_cpu_supports, <immintrin.h>) sits behind `#if defined(RECPIPE_X86_DISPATCH)`
// beside a portable path that gives bit-identical results: the ISA chosen
// changes speed only, never control flow or results. Any other 64-bit target
// (aarch64, ppc64le, ...) builds the portable paths.
//
// Floating-point results stay identical across ISAs because setup.py compiles
// with -ffp-contract=off: a CPU whose baseline has FMA (aarch64) would otherwise
// fuse a * b + c into one rounding where x86-64 rounds twice.
#pragma once

#if defined(__x86_64__) && !defined(RECPIPE_PORTABLE)
#define RECPIPE_X86_DISPATCH 1
#endif

namespace recpipe {

// The dispatch compiled into this build, as recpipe._C.CPU_DISPATCH reports it:
// "x86" (per-call choice among AVX-512, AVX2 and baseline x86-64) or "portable".
#if defined(RECPIPE_X86_DISPATCH)
inline constexpr const char* kCpuDispatch = "x86";
#else
inline constexpr const char* kCpuDispatch = "portable";
#endif

}  // namespace recpipe
