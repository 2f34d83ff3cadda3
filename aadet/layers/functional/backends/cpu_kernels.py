"""Building the C++ CPU kernels under ``csrc/`` (SASA's :mod:`.sasa_cpp`, AA's
:mod:`.aa_cpp`, HaloNet's :mod:`.halonet_cpp`, the SASA attention stem's :mod:`.stem_cpp`):
compiled on first use, cached, and a clean fallback where they cannot be.

Each kernel is one source file (plus the shared header ``csrc/cpu_simd.h``) compiled by
:func:`torch.utils.cpp_extension.load` with g++ and ninja, optimized for the CPU it runs on
(``-march=native``), and cached under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) under a name that hashes the sources, the flags and the CPU, so a
shared cache never hands one CPU's build to another. ``make setup`` builds every kernel once
(:func:`main`). Where a kernel cannot be built (no compiler, or ``AADET_CPP_KERNELS=0``),
:meth:`CppKernel.available` is False, ``impl="auto"`` keeps the kernel's pure-PyTorch fallback
(one warning says why), and naming ``impl="cpp"`` raises with the build error.
"""
import hashlib
import logging
import os
import platform
import sys
from typing import Dict, Optional

__all__ = ["CFLAGS", "ENV_SWITCH", "KERNELS", "CppKernel"]

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
#: Headers every kernel includes (part of each build's cache key).
_HEADERS = ("cpu_simd.h",)
# -march=native: the build is for the CPU it runs on (its name is part of the cache key below);
# -ffast-math for vectorized exp and reassociated sums, but keep IEEE infinities and NaN checks.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
#: Environment variable that turns the C++ kernels off (``0``): ``auto`` then takes the pure-PyTorch routes.
ENV_SWITCH = "AADET_CPP_KERNELS"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ninja_on_path() -> None:
    """``pip install ninja`` puts ninja next to this interpreter, which is on PATH only in an
    activated environment; PyTorch's builder looks for it on PATH."""
    bindir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bindir, "ninja")):
        path = os.environ.get("PATH", "")
        if bindir not in path.split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + path


class CppKernel:
    """One C++ kernel: ``csrc/<source>``, built once per process (and cached across processes).

    Args:
        source: file name under ``csrc/``.
        what: the kernel's name in messages (``"SASA C++ kernel"``).
        fallback: the route ``impl="auto"`` takes without it (named in the warning).
    """

    def __init__(self, source: str, what: str, fallback: str):
        self.source = os.path.join(_CSRC, source)
        self.what = what
        self.fallback = fallback
        self._ext = None
        self._error: Optional[str] = None

    def extension_name(self) -> str:
        """``aadet_<source stem>_<hash of sources, flags and CPU>``."""
        h = hashlib.sha1()
        for path in (self.source, *(os.path.join(_CSRC, n) for n in _HEADERS)):
            with open(path, "rb") as f:
                h.update(f.read())
        h.update(" ".join(CFLAGS).encode())
        h.update(_cpu_name().encode())
        stem = os.path.splitext(os.path.basename(self.source))[0]
        return f"aadet_{stem}_{h.hexdigest()[:12]}"

    def build(self, verbose: bool = False):
        """Compile (or load the cached build of) the kernel. Returns the module, or None with
        :meth:`build_error` saying why (compiler missing, ``AADET_CPP_KERNELS=0``, ...)."""
        if self._ext is not None or self._error is not None:
            return self._ext
        if os.environ.get(ENV_SWITCH, "1") == "0":
            self._error = f"{ENV_SWITCH}=0"
            return None
        try:
            from torch.utils.cpp_extension import load

            _ninja_on_path()
            logger.info("aadet: loading the %s (compiled once per machine and cached)", self.what)
            self._ext = load(
                name=self.extension_name(), sources=[self.source], extra_cflags=CFLAGS,
                extra_ldflags=_LDFLAGS, extra_include_paths=[_CSRC], verbose=verbose,
            )
        except Exception as e:  # no compiler, no ninja, a failed build: report, fall back
            self._error = f"{type(e).__name__}: {e}".strip()
            logger.warning(
                "aadet: the %s did not build (%s); on CPU the slower '%s' route is used instead. "
                "`make setup` needs g++ and ninja.", self.what, self._error.splitlines()[0], self.fallback,
            )
        return self._ext

    def available(self) -> bool:
        """True if the kernel is built or builds now (the first call may compile it, ~1 minute)."""
        return self.build() is not None

    def build_error(self) -> Optional[str]:
        """Why the kernel is unavailable (None if it is available or was not tried)."""
        return self._error

    @staticmethod
    def check_device(t, impl: str = "cpp") -> None:
        """The kernels run on CPU tensors: raises ValueError for ``t`` on another device."""
        if t.device.type != "cpu":
            raise ValueError(f"impl='{impl}' runs on CPU tensors; got {t.device.type} (use impl='auto')")

    def extension(self, impl: str = "cpp"):
        """The built module; raises RuntimeError naming the build error where there is none."""
        ext = self.build()
        if ext is None:
            raise RuntimeError(
                f"impl='{impl}' needs the {self.what}, which did not build: {self._error}. Use "
                f"impl='{self.fallback}' (or 'auto'), or install g++ and ninja (`make setup` builds it)."
            )
        return ext


#: Every C++ kernel: SASA's (:mod:`.sasa_cpp`), AA's (:mod:`.aa_cpp`), HaloNet's
#: (:mod:`.halonet_cpp`), the SASA attention stem's (:mod:`.stem_cpp`; its fallback is the route
#: ``impl="auto"`` takes without it for an RGB stem).
KERNELS: Dict[str, CppKernel] = {
    "sasa": CppKernel("sasa_cpu.cpp", "SASA C++ kernel", fallback="neighborhood"),
    "aa": CppKernel("aa_cpu.cpp", "AA C++ kernel", fallback="fused"),
    "halonet": CppKernel("halonet_cpu.cpp", "HaloNet C++ kernel", fallback="bmm"),
    "stem": CppKernel("stem_cpu.cpp", "SASA attention stem C++ kernel", fallback="factorized"),
}


def main(argv=None) -> int:
    """``make setup``: build every kernel once, say which routes get them (never fails: the
    routes fall back)."""
    import argparse

    parser = argparse.ArgumentParser(description="Build the C++ CPU kernels (cached).")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for kernel in KERNELS.values():
        ext = kernel.build(verbose=args.verbose)
        if ext is None:
            print(f"[aadet] {kernel.what}: not built ({kernel.build_error()}); "
                  f"the CPU uses '{kernel.fallback}'")
        else:
            print(f"[aadet] {kernel.what}: ready ({ext.__file__})")
    return 0
