"""Compile the patched llama.cpp + native/ once, cached by what went into it.

The cache key hashes (sdist sha256, every patch, every file under native/, CMakeLists.txt, the
build flags, and the CPU's feature flags for a GGML_NATIVE build). An unchanged rebuild only hashes
those inputs and returns. A changed one reuses a persistent CMake tree per variant (with ccache
when present), so only what changed is recompiled.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from saem_gguf.build.paths import CMAKELISTS, NATIVE_DIR, PATCHES_DIR, REPO_ROOT, cache_root
from saem_gguf.build.source import SDIST_SHA256, fetch_sdist, patch_files, prepare_source
from saem_gguf.errors import BuildError

LIB_NAMES = ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so")


# A portable (GGML_NATIVE=OFF) x86-64 build's instruction sets, given explicitly: x86-64-v3 (AVX2,
# FMA, F16C, BMI2), what any GPU host of the last decade has, and nothing newer. ggml's own default
# for them is ON only in a fresh CMake tree configured without GGML_NATIVE (and not under
# SOURCE_DATE_EPOCH); the tree a native build configured first keeps them OFF in its cache, and
# the "portable" library was then scalar (measured: 4.7x slower decode, 11x slower prefill).
PORTABLE_X86_ISA = (("GGML_SSE42", True), ("GGML_AVX", True), ("GGML_AVX2", True), ("GGML_BMI2", True),
                    ("GGML_FMA", True), ("GGML_F16C", True), ("GGML_AVX_VNNI", False), ("GGML_AVX512", False),
                    ("GGML_AVX512_VBMI", False), ("GGML_AVX512_VNNI", False), ("GGML_AVX512_BF16", False),
                    ("GGML_AMX_TILE", False), ("GGML_AMX_INT8", False), ("GGML_AMX_BF16", False))


def portable_isa_args(machine: str | None = None) -> list[str]:
    """The -D flags of PORTABLE_X86_ISA on an x86-64 host; none elsewhere (ggml's defaults)."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return []
    return [f"-D{name}={'ON' if on else 'OFF'}" for name, on in PORTABLE_X86_ISA]


@dataclass(frozen=True)
class BuildConfig:
    variant: str = "saem"  # "saem": patches + native/ ; "stock": the unpatched vendored llama.cpp
    cuda: bool = False
    cuda_arch: str = "90"
    build_type: str = "Release"
    native_cpu: bool = True  # GGML_NATIVE: tune for this CPU (key includes its feature flags)
    # FlashAttention CUDA kernels (GGML_CUDA_FA). Off: they are about half of libggml-cuda's compile
    # time, and llama.cpp's flash_attn "auto" then runs attention without them on every policy alike.
    cuda_fa: bool = False

    @property
    def flavor(self) -> str:
        return f"{self.variant}-{'cuda' + self.cuda_arch if self.cuda else 'cpu'}"

    def key_fields(self) -> dict[str, object]:
        """What the build key hashes: CUDA-only fields only for a CUDA build (CPU keys stay as they were)."""
        fields = asdict(self)
        if not self.cuda:
            fields.pop("cuda_fa")
        return fields

    def cmake_args(self) -> list[str]:
        args = [f"-DCMAKE_BUILD_TYPE={self.build_type}",
                f"-DGGML_NATIVE={'ON' if self.native_cpu else 'OFF'}",
                f"-DSAEM_CUDA={'ON' if self.cuda else 'OFF'}",
                f"-DSAEM_WITH_NATIVE={'ON' if self.variant == 'saem' else 'OFF'}"]
        if not self.native_cpu:
            args += portable_isa_args()
        if self.cuda:
            # NO_VMM: no link against the driver's libcuda, so the library builds on a machine
            # without a GPU driver; NCCL: one GPU, and the wheel is not there to link against.
            args += [f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_arch}", "-DGGML_CUDA_NO_VMM=ON",
                     "-DGGML_CUDA_NCCL=OFF", f"-DGGML_CUDA_FA={'ON' if self.cuda_fa else 'OFF'}"]
        return args


def cublas_root() -> Path | None:
    """A directory holding include/cublas_v2.h and lib/libcublas.so*, when the CUDA toolkit has none.

    $CUBLAS_ROOT first; else None when nvcc's toolkit ships cuBLAS; else the ``nvidia-cublas``
    wheel (``nvidia/cu13``) in ``$SAEM_GGUF_CACHE/cuda-deps`` (where ``pip install --target`` puts it)
    or on this Python's path."""
    env = os.environ.get("CUBLAS_ROOT")
    if env:
        return Path(env)
    nvcc = shutil.which("nvcc")
    if nvcc:
        toolkit = Path(nvcc).resolve().parent.parent
        if any(toolkit.glob("lib64/libcublas.so*")) or any(toolkit.glob("targets/*/lib/libcublas.so*")):
            return None
    bases = [cache_root() / "cuda-deps" / "nvidia"] + [Path(p) / "nvidia" for p in sys.path if p]
    for base in bases:
        for d in sorted(base.glob("*")) if base.is_dir() else []:
            if (d / "include" / "cublas_v2.h").exists() and any(d.glob("lib/libcublas.so*")):
                return d
    return None


def _cublas_cmake_args(root: Path, links: Path) -> list[str]:
    """Point FindCUDAToolkit at a wheel's cuBLAS: it ships only libcublas.so.13, so link names are made."""
    links.mkdir(parents=True, exist_ok=True)
    for name in ("cublas", "cublasLt"):
        found = sorted(root.glob(f"lib/lib{name}.so*"))
        if not found:
            raise BuildError(f"{root}/lib has no lib{name}.so*: not a cuBLAS directory")
        link = links / f"lib{name}.so"
        link.unlink(missing_ok=True)
        link.symlink_to(found[0])
    inc = f"-I{root / 'include'}"
    # executables linked against libggml-cuda (native/tests) need its libcublas.so.13 at link time
    rpath_link = f"-Wl,-rpath-link,{root / 'lib'}"
    return [f"-DCUDA_cublas_LIBRARY={links / 'libcublas.so'}",
            f"-DCUDA_cublasLt_LIBRARY={links / 'libcublasLt.so'}",
            f"-DCMAKE_CUDA_FLAGS={inc}", f"-DCMAKE_CXX_FLAGS={inc}",
            f"-DCMAKE_SHARED_LINKER_FLAGS={rpath_link}", f"-DCMAKE_EXE_LINKER_FLAGS={rpath_link}"]


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return hashlib.sha256(line.encode()).hexdigest()[:12]
    except OSError:
        pass
    return platform.machine()


def _hash_tree(h: "hashlib._Hash", root: Path) -> None:
    if not root.exists():
        return
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())


def build_key(cfg: BuildConfig) -> str:
    h = hashlib.sha256()
    h.update(SDIST_SHA256.encode())
    h.update(json.dumps(cfg.key_fields(), sort_keys=True).encode())
    h.update(CMAKELISTS.read_bytes())
    if cfg.variant == "saem":
        for p in patch_files(PATCHES_DIR):
            h.update(p.name.encode())
            h.update(p.read_bytes())
        _hash_tree(h, NATIVE_DIR)
    if cfg.native_cpu:
        h.update(_cpu_signature().encode())
    else:
        h.update(" ".join(portable_isa_args()).encode())
    return f"{cfg.flavor}-{h.hexdigest()[:16]}"


def library_dir(cfg: BuildConfig) -> Path:
    return cache_root() / "builds" / build_key(cfg) / "lib"


def find_build(cfg: BuildConfig) -> Path | None:
    lib = library_dir(cfg)
    stamp = lib.parent / "build.json"
    if stamp.exists() and all((lib / n).exists() for n in LIB_NAMES):
        return lib
    return None


def _run_with_progress(cmd: list[str], log: Path, desc: str, quiet: bool) -> None:
    """Run a build command, showing CMake's [ NN%] lines as a progress bar; full output to ``log``."""
    from tqdm import tqdm

    bar = None if quiet else tqdm(total=100, desc=desc, unit="%", file=sys.stderr,
                                  bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")
    pct = re.compile(r"^\[\s*(\d+)%\]")
    with open(log, "a") as lf:
        lf.write(f"$ {' '.join(cmd)}\n")
        # relative paths under the cache let ccache share objects between checkouts' build trees
        env = {**os.environ, "CCACHE_BASEDIR": str(cache_root() / "work")}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            lf.write(line)
            m = pct.match(line)
            if m and bar is not None:
                bar.n = int(m.group(1))
                bar.refresh()
        rc = proc.wait()
    if bar is not None:
        if rc == 0:
            bar.n = 100
        bar.close()
    if rc != 0:
        tail = log.read_text().splitlines()[-25:]
        raise BuildError(f"{desc} failed (exit {rc}); full log: {log}\n" + "\n".join(tail))


def build(cfg: BuildConfig = BuildConfig(), jobs: int | None = None, force: bool = False,
          quiet: bool = False) -> Path:
    """Return the directory holding libllama.so & co. for ``cfg``, building it if needed."""
    found = None if force else find_build(cfg)
    if found:
        return found
    for tool in ("cmake", "patch"):
        if not shutil.which(tool):
            raise BuildError(f"'{tool}' is not installed; it is needed to build llama.cpp")
    t0 = time.time()
    key = build_key(cfg)
    # one CMake tree per (checkout, flavour): two checkouts never build in the same tree at once
    tree_id = hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:8]
    work = cache_root() / "work" / f"{cfg.flavor}-{tree_id}"
    src, bld = work / "llama.cpp", work / "build"
    prefix = cache_root() / "builds" / key
    log = work / "build.log"
    work.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    if not quiet:
        print(f"building llama.cpp ({cfg.flavor}) -> {prefix}", file=sys.stderr)
    sdist = fetch_sdist(quiet=quiet)
    prepare_source(src, patch_files(PATCHES_DIR) if cfg.variant == "saem" else [], sdist)
    t_src = time.time() - t0
    configure = ["cmake", "-S", str(REPO_ROOT), "-B", str(bld), f"-DSAEM_LLAMA_SRC={src}",
                 *cfg.cmake_args()]
    if cfg.cuda:
        if not shutil.which("nvcc"):
            raise BuildError("a CUDA build needs nvcc (the CUDA toolkit) on PATH")
        cublas = cublas_root()
        if cublas is not None:
            configure += _cublas_cmake_args(cublas, work / "cublas-links")
    if shutil.which("ccache"):
        configure += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        if cfg.cuda:
            configure.append("-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache")
    _run_with_progress(configure, log, "configure", quiet=True)
    jobs = jobs or os.cpu_count() or 2
    _run_with_progress(["cmake", "--build", str(bld), "-j", str(jobs)], log, "compile", quiet)
    if prefix.exists():
        shutil.rmtree(prefix)
    _run_with_progress(["cmake", "--install", str(bld), "--prefix", str(prefix)], log, "install", True)
    lib = prefix / "lib"
    missing = [n for n in LIB_NAMES if not (lib / n).exists()]
    if missing:
        raise BuildError(f"build finished but {', '.join(missing)} missing in {lib}; log: {log}")
    stamp = {"key": key, "config": asdict(cfg), "seconds": round(time.time() - t0, 1),
             "source_seconds": round(t_src, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (prefix / "build.json").write_text(json.dumps(stamp, indent=2))
    return lib
