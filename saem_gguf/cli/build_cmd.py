"""`build`: compile the patched llama.cpp once (cached; an unchanged rebuild takes seconds)."""

from __future__ import annotations

import argparse
import sys
import time

from saem_gguf.build import BuildConfig, build


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build the patched llama.cpp (cached)",
                       description="Fetch the llama.cpp vendored by llama-cpp-python==0.3.36, apply "
                                   "patches/, compile it with native/ and cache the libraries.")
    p.add_argument("--cuda", action="store_true", help="build the CUDA backend (GGML_CUDA)")
    p.add_argument("--cuda-arch", default="90", help="CUDA architectures (default: 90)")
    p.add_argument("--cuda-fa", action="store_true",
                   help="also compile the FlashAttention CUDA kernels (GGML_CUDA_FA; about doubles "
                        "the CUDA compile time)")
    p.add_argument("--variant", choices=("saem", "stock"), default="saem",
                   help="saem = patched (default); stock = unpatched, for baselines")
    p.add_argument("--portable", action="store_true", help="no -march=native (GGML_NATIVE=OFF)")
    p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs")
    p.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = BuildConfig(variant=args.variant, cuda=args.cuda, cuda_arch=args.cuda_arch,
                      native_cpu=not args.portable, cuda_fa=args.cuda_fa)
    t0 = time.time()
    lib = build(cfg, jobs=args.jobs, force=args.force, quiet=args.quiet)
    if not args.quiet:
        print(f"{cfg.flavor}: {lib} ({time.time() - t0:.1f} s)", file=sys.stderr)
    print(lib)
    return 0
