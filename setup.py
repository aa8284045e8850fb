"""Build recpipe: the namespace package ``recpipe`` and the extension ``recpipe._C``.

Layout (README.md, "Layout"): each top-level folder is one subpackage of ``recpipe``
(``pipeline/`` -> ``recpipe.pipeline``, ``planner/`` -> ``recpipe.planner``,
``recipes/`` -> ``recpipe.recipes``); there is no ``recpipe/__init__.py`` (a PEP 420
namespace package). ``csrc/*.cpp`` always build; ``csrc/*.cu`` build when nvcc and
a CUDA build of torch are both present, unless ``RECPIPE_CUDA=0``.
``RECPIPE_CUDA=1`` makes a missing toolkit an error instead of a silent CPU-only build.

CPU dispatch (``csrc/cpu_dispatch.h``): on x86-64 the kernels pick AVX-512, AVX2
or baseline x86-64 per call; every other 64-bit CPU (aarch64, ...) builds the
portable paths. ``RECPIPE_PORTABLE=1`` adds ``-DRECPIPE_PORTABLE=1`` to the C++
and nvcc flags, so an x86-64 build compiles the portable paths too
(``recpipe._C.CPU_DISPATCH`` reports ``"portable"``; ``make test-portable``
runs the op tests against such a build). Both give bit-identical results: the
ISA changes speed only, and ``-ffp-contract=off`` keeps a CPU with FMA in its
baseline from fusing ``a * b + c`` into one rounding.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _find_cuda_home() -> str | None:
    """The CUDA toolkit root: $CUDA_HOME, else the directory of the real nvcc."""
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env and Path(env, "bin", "nvcc").exists():
        return env
    for cand in sorted(glob.glob("/usr/local/cuda-*")) + ["/usr/local/cuda"]:
        if Path(cand, "bin", "nvcc").exists():
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(os.path.realpath(nvcc)).parent.parent)
    return None


_cuda_home = _find_cuda_home()
if _cuda_home:
    # torch.utils.cpp_extension reads CUDA_HOME at import time.
    os.environ.setdefault("CUDA_HOME", _cuda_home)

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _want_cuda() -> bool:
    flag = os.environ.get("RECPIPE_CUDA", "auto").lower()
    have = torch.version.cuda is not None and _cuda_home is not None
    if flag in ("0", "false", "off", "no"):
        return False
    if flag in ("1", "true", "on", "yes") and not have:
        sys.exit(
            "RECPIPE_CUDA=1 but no CUDA build is possible: "
            f"torch.version.cuda={torch.version.cuda!r}, nvcc toolkit={_cuda_home!r}. "
            "Install a CUDA build of torch and the CUDA toolkit, or set RECPIPE_CUDA=0."
        )
    return have


def _want_portable() -> bool:
    """Whether ``RECPIPE_PORTABLE`` asks for the portable CPU paths on x86-64 too.

    Returns:
        bool: True for ``1``/``true``/``on``/``yes``, False when unset or ``0``/``false``/``off``/``no``.

    Raises:
        SystemExit: any other value, naming the variable and the accepted values.
    """
    flag = os.environ.get("RECPIPE_PORTABLE", "0").strip().lower()
    if flag in ("", "0", "false", "off", "no"):
        return False
    if flag in ("1", "true", "on", "yes"):
        return True
    sys.exit(f"RECPIPE_PORTABLE={flag!r}: set it to 1 (portable CPU paths) or 0 / unset (x86 dispatch on x86-64).")


def _extension():
    cpp = sorted(glob.glob("csrc/*.cpp"))
    # -ffp-contract=off: the same float roundings on every CPU (module docstring).
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off"]
    macros = [("RECPIPE_PORTABLE", "1")] if _want_portable() else []
    if not _want_cuda():
        return CppExtension(
            "recpipe._C", cpp, define_macros=macros, extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"]
        )
    # CUDA build. CUDAContext.h pulls in cusparse.h, which pip-installed torch
    # keeps under site-packages/nvidia/cu13/include (measured on the project machines).
    include_dirs = [str(Path(_cuda_home, "include"))]
    for site in map(Path, sys.path):
        for sub in ("nvidia/cu13/include", "nvidia/cusparse/include"):
            if (site / sub).is_dir():
                include_dirs.append(str(site / sub))
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    return CUDAExtension(
        "recpipe._C",
        cpp + sorted(glob.glob("csrc/*.cu")),
        include_dirs=include_dirs,
        library_dirs=[str(Path(_cuda_home, "lib64"))],
        define_macros=[("RECPIPE_WITH_CUDA", "1"), *macros],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++20"]},
        extra_link_args=["-fopenmp"],
    )


SUBPACKAGES = {"pipeline": "pipeline", "planner": "planner", "recipes": "recipes"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for sub, folder in SUBPACKAGES.items():
        for init in sorted(Path(ROOT, folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join(["recpipe", sub, *rel.parts])
            packages.append(name)
            package_dir[name] = str(Path(folder, *rel.parts))
    return packages, package_dir


_pkgs, _pkg_dir = _packages()

setup(
    name="recpipe",
    version="0.1.0",
    description="Training-pipeline runtime for torchrec: fused sparse-dist pipeline, "
    "placement planner, routing op, tiered embedding storage, recipes.",
    python_requires=">=3.11",
    packages=_pkgs,
    package_dir=_pkg_dir,
    package_data={"recpipe.recipes": ["configs/*.yaml"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={"torchx.components": ["recpipe = recpipe.recipes.components", "dist = torchx.components.dist"]},
    zip_safe=False,
)
