"""`build`: compile the patched llama.cpp once (cached; an unchanged rebuild takes seconds).

Every flag that becomes part of a CMake argument or a path (``--cuda-arch``, ``--jobs``) is checked
against a strict pattern first: CMake splits arguments at ``;`` and the architecture names the
build's cache directory, so free text there could create folders or pass extra CMake options.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path

from saem_gguf.build import BuildConfig, build
from saem_gguf.cli.arg_types import bounded_int
from saem_gguf.errors import BuildError, SaemError

# one CMAKE_CUDA_ARCHITECTURES entry: 89, 90a, 100f, 86-real, 90-virtual, or CMake's keywords
CUDA_ARCH = re.compile(r"(?:[1-9][0-9]{1,2}[af]?(?:-real|-virtual)?|native|all|all-major)")
MAX_JOBS = 256
# where CMake looks for nvcc besides $CUDACXX and PATH
DEFAULT_NVCC = Path("/usr/local/cuda/bin/nvcc")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build the patched llama.cpp (cached)",
                       description="Fetch the llama.cpp vendored by llama-cpp-python==0.3.36, apply "
                                   "patches/, compile it with native/ and cache the libraries.")
    p.add_argument("--cuda", action="store_true", help="build the CUDA backend (GGML_CUDA)")
    p.add_argument("--cuda-arch", type=_cuda_arch, default="90",
                   help="CUDA architecture, e.g. 89, 90a, 86-real, native (default: 90)")
    p.add_argument("--cuda-fa", action="store_true",
                   help="also compile the FlashAttention CUDA kernels (GGML_CUDA_FA; about doubles "
                        "the CUDA compile time)")
    p.add_argument("--variant", choices=("saem", "stock"), default="saem",
                   help="saem = patched (default); stock = unpatched, for baselines")
    p.add_argument("--portable", action="store_true", help="no -march=native (GGML_NATIVE=OFF)")
    p.add_argument("-j", "--jobs", type=bounded_int(1, MAX_JOBS), default=None, help="parallel compile jobs")
    p.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def _cuda_arch(text: str) -> str:
    if not CUDA_ARCH.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a CUDA architecture (one of: a compute capability such as 89, 90a, "
            "86-real, 90-virtual; native; all; all-major)")
    return text


def nvcc_path() -> str | None:
    """The nvcc CMake would find: $CUDACXX, then PATH, then /usr/local/cuda."""
    env = os.environ.get("CUDACXX")
    if env:
        return env if Path(env).is_file() else None
    return shutil.which("nvcc") or (str(DEFAULT_NVCC) if DEFAULT_NVCC.is_file() else None)


def run(args: argparse.Namespace) -> int:
    cfg = BuildConfig(variant=args.variant, cuda=args.cuda, cuda_arch=args.cuda_arch,
                      native_cpu=not args.portable, cuda_fa=args.cuda_fa)
    if cfg.cuda and nvcc_path() is None:
        raise SaemError("build --cuda needs the CUDA compiler, and nvcc is not found ($CUDACXX, "
                        "PATH, /usr/local/cuda/bin): install the CUDA toolkit or set CUDACXX")
    t0 = time.time()
    try:
        lib = build(cfg, jobs=args.jobs, force=args.force, quiet=args.quiet)
    except BuildError as e:
        raise BuildError(one_line(str(e))) from None
    if not args.quiet:
        print(f"{cfg.flavor}: {lib} ({time.time() - t0:.1f} s)", file=sys.stderr)
    print(lib)
    return 0


def one_line(message: str) -> str:
    """A build failure in one line: the builder's summary (which names the full log) and the
    first compiler/CMake error line of the log tail it quotes, if any."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "build failed"
    first_error = next((line for line in lines[1:] if re.search(r"\berror\b", line, re.I)), None)
    return lines[0] + (f" [{first_error[:200]}]" if first_error else "")
