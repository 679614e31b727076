"""The llama.cpp source: the tree vendored in the llama-cpp-python sdist, verified and patched.

Run as ``python -m saem_gguf.build.source --out DIR [--patches DIR]`` (CMakeLists.txt does this
when it is not handed a prepared tree).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from saem_gguf.build.paths import PATCHES_DIR, cache_root
from saem_gguf.errors import BuildError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT = "0c1e570"
VENDOR_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(quiet: bool = False) -> Path:
    """Download the sdist with pip (once) into the cache and verify its sha256."""
    dest = cache_root() / "sdist"
    path = dest / SDIST_NAME
    if path.exists() and sha256_file(path) == SDIST_SHA256:
        return path
    dest.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"fetching llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist with pip (about 77 MB)...",
              file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dest), "-q"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not path.exists():
        raise BuildError(f"pip could not download {SDIST_NAME}: {r.stderr.strip()[-500:]}")
    got = sha256_file(path)
    if got != SDIST_SHA256:
        path.unlink(missing_ok=True)
        raise BuildError(f"{SDIST_NAME}: sha256 {got} does not match the pinned {SDIST_SHA256}")
    return path


def patch_files(patches_dir: Path = PATCHES_DIR) -> list[Path]:
    return sorted(p for p in patches_dir.glob("*.patch") if p.is_file()) if patches_dir.is_dir() else []


def extract_llama_cpp(sdist: Path, out: Path) -> None:
    """Extract vendor/llama.cpp (without its git link and bulky vocab inputs we do not use)."""
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar.getmembers():
            if not m.name.startswith(VENDOR_PREFIX):
                continue
            rel = m.name[len(VENDOR_PREFIX):]
            if not rel or rel == ".git" or rel.startswith(".git/"):
                continue
            if not (m.isfile() or m.isdir() or m.issym()):
                continue
            m.name = rel
            tar.extract(m, out, filter="data")


def apply_patches(tree: Path, patches: list[Path]) -> None:
    for p in patches:
        r = subprocess.run(["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch",
                            "-d", str(tree), "-i", str(p)], capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"patch {p.name} does not apply to llama.cpp {LLAMA_CPP_COMMIT}:\n"
                             f"{(r.stdout + r.stderr).strip()[-2000:]}")


def prepare_source(out: Path, patches: list[Path], sdist: Path | None = None) -> Path:
    """Write the patched tree to ``out``; only files whose bytes changed are rewritten.

    Keeping unchanged files untouched (mtimes included) lets an existing CMake build tree rebuild
    just what a patch change touched.
    """
    sdist = sdist or fetch_sdist()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="saem-src-", dir=out.parent) as tmp:
        fresh = Path(tmp) / "llama.cpp"
        fresh.mkdir()
        extract_llama_cpp(sdist, fresh)
        apply_patches(fresh, patches)
        (fresh / "SAEM_COMMIT").write_text(LLAMA_CPP_COMMIT + "\n")
        _sync_tree(fresh, out)
    return out


def _sync_tree(src: Path, dst: Path) -> None:
    seen: set[Path] = set()
    for s in src.rglob("*"):
        rel = s.relative_to(src)
        d = dst / rel
        seen.add(rel)
        if s.is_dir() and not s.is_symlink():
            d.mkdir(parents=True, exist_ok=True)
            continue
        if d.is_file() and not d.is_symlink() and not s.is_symlink():
            if d.stat().st_size == s.stat().st_size and d.read_bytes() == s.read_bytes():
                continue
        d.parent.mkdir(parents=True, exist_ok=True)
        if d.exists() or d.is_symlink():
            d.unlink()
        shutil.copy2(s, d, follow_symlinks=False)
    for d in sorted(dst.rglob("*"), reverse=True):
        rel = d.relative_to(dst)
        if rel not in seen:
            shutil.rmtree(d) if d.is_dir() and not d.is_symlink() else d.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fetch, verify and patch the vendored llama.cpp source.")
    ap.add_argument("--out", required=True, type=Path, help="directory for the patched tree")
    ap.add_argument("--patches", type=Path, default=PATCHES_DIR, help="directory of *.patch files")
    ap.add_argument("--stock", action="store_true", help="apply no patches")
    args = ap.parse_args(argv)
    try:
        prepare_source(args.out.resolve(), [] if args.stock else patch_files(args.patches))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
