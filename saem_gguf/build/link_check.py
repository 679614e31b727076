"""Link check of a built library set, without loading it (a CUDA build cannot be loaded here).

  - every library's dependencies resolve and its undefined symbols bind (``ldd -r``);
  - libllama exports every function of ``native/saem_native.h`` and every function the installed
    llama-cpp-python binds (its ``@ctypes_function("name", ...)`` declarations are looked up at
    import, so one missing symbol breaks ``import llama_cpp``), from itself or a library it needs.

    python -m saem_gguf.build.link_check LIBDIR [--extra-path DIR]   # exit 1 with the misses
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from saem_gguf.build.paths import NATIVE_DIR


@dataclass
class LinkReport:
    libraries: dict[str, str] = field(default_factory=dict)  # name -> "ok" or the ldd -r complaint
    native_symbols: int = 0
    binding_symbols: int = 0
    missing: list[str] = field(default_factory=list)  # symbols the bindings or saem_native.h need

    @property
    def ok(self) -> bool:
        return not self.missing and all(v == "ok" for v in self.libraries.values())


def native_api_symbols(header: Path = NATIVE_DIR / "saem_native.h") -> set[str]:
    return set(re.findall(r"\b(saem_\w+)\s*\(", header.read_text())) - {"saem_moe_cache"}


def binding_symbols() -> set[str]:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("llama-cpp-python is not installed")
    names: set[str] = set()
    for py in ("llama_cpp.py", "_ggml.py"):
        path = Path(spec.origin).parent / py
        if path.exists():
            names |= set(re.findall(r'@ctypes_function\(\s*"(\w+)"', path.read_text()))
    return names


def _exported(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def check(lib_dir: Path, extra_paths: list[Path] = ()) -> LinkReport:
    env = dict(os.environ)
    if extra_paths:
        env["LD_LIBRARY_PATH"] = ":".join([*map(str, extra_paths), env.get("LD_LIBRARY_PATH", "")])
    rep = LinkReport()
    exported: set[str] = set()
    for lib in sorted(p for p in lib_dir.glob("lib*.so") if p.exists()):
        r = subprocess.run(["ldd", "-r", str(lib)], capture_output=True, text=True, env=env)
        bad = [line.strip() for line in (r.stdout + r.stderr).splitlines()
               if "not found" in line or "undefined symbol" in line]
        rep.libraries[lib.name] = "ok" if r.returncode == 0 and not bad else "; ".join(bad[:5]) or r.stderr
        exported |= _exported(lib)
    native, bindings = native_api_symbols(), binding_symbols()
    rep.native_symbols, rep.binding_symbols = len(native), len(bindings)
    # libllama is what llama-cpp-python dlopens; a symbol it binds may come from a ggml library
    rep.missing = sorted((native | bindings) - exported)
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m saem_gguf.build.link_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib_dir", type=Path)
    ap.add_argument("--extra-path", type=Path, action="append", default=[],
                    help="another directory for the loader (e.g. the cuBLAS wheel's lib)")
    args = ap.parse_args(argv)
    rep = check(args.lib_dir, args.extra_path)
    for name, status in rep.libraries.items():
        print(f"{name}: {status}")
    print(f"symbols: {rep.native_symbols} of saem_native.h, {rep.binding_symbols} bound by llama-cpp-python; "
          f"missing: {', '.join(rep.missing) or 'none'}")
    if not rep.ok:
        print("error: the library set does not link completely", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
