"""The device bundle: a prebuilt library set of the current sources, packed to travel with the tree.

A GPU machine is lent for minutes at a time, so the CUDA libraries are compiled here (no GPU needed)
and packed into ``.device/`` by ``bench/device/prepare.sh``; ``bench/device/run.sh`` unpacks them
there. The bundle records the build key (``builder.build_key``) of what it holds, and unpacking
refuses a bundle whose key is not the key of the sources beside it: a library built from other
patches or native/ sources is never measured by mistake.

    python -m saem_gguf.build.bundle pack   --lib LIBDIR --out .device [--cuda-arch 90 | --cpu]
    python -m saem_gguf.build.bundle check  --bundle .device [--cuda-arch 90 | --cpu]
    python -m saem_gguf.build.bundle unpack --bundle .device --dest DIR [--cuda-arch 90 | --cpu]

--cpu: this machine's CPU build (BuildConfig()), what the dry run of the device script packs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from saem_gguf.build.builder import BuildConfig, build_key
from saem_gguf.build.source import sha256_file
from saem_gguf.errors import BuildError

MANIFEST = "bundle.json"
LIBS_ARCHIVE = "libs.tar.xz"


def device_config(cuda_arch: str = "90") -> BuildConfig:
    """The build a device bundle holds: CUDA for one architecture, CPU code portable (no -march=native:
    the GPU machine's processor is not this one)."""
    return BuildConfig(cuda=True, cuda_arch=cuda_arch, native_cpu=False)


@dataclass(frozen=True)
class Manifest:
    key: str
    config: dict
    files: dict[str, str]  # library file name -> sha256 of the stripped file
    links: dict[str, str]  # soname symlink -> its target
    archive_bytes: int
    unpacked_bytes: int
    created: str

    @classmethod
    def read(cls, bundle: Path) -> "Manifest":
        path = bundle / MANIFEST
        if not path.is_file():
            raise BuildError(f"{bundle} holds no device bundle ({MANIFEST} missing); "
                             "run bench/device/prepare.sh")
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise BuildError(f"{path} is not a device bundle manifest: {e}") from None


def pack(lib_dir: Path, out: Path, cfg: BuildConfig) -> Manifest:
    """Strip the shared libraries of ``lib_dir`` and write them, xz-compressed, to ``out``."""
    entries = sorted(lib_dir.glob("*.so*"))
    key = build_key(cfg)
    stamp = lib_dir.parent / "build.json"
    built = json.loads(stamp.read_text()).get("key") if stamp.is_file() else None
    if built != key or not (lib_dir / "libllama.so").exists():
        raise BuildError(f"{lib_dir} is not the build {key} of the sources here (it is {built}): "
                         "build it first (python -m saem_gguf build " +
                         (f"--cuda --cuda-arch {cfg.cuda_arch} --portable)" if cfg.cuda else ")"))
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    links: dict[str, str] = {}
    unpacked = 0
    with tempfile.TemporaryDirectory(prefix="saem-bundle-") as tmp:
        staged = Path(tmp)
        for entry in entries:
            dst = staged / entry.name
            if entry.is_symlink():  # libllama.so -> libllama.so.0 -> libllama.so.0.5.0 (sonames)
                links[entry.name] = os.readlink(entry)
                dst.symlink_to(links[entry.name])
                continue
            # symbols of the dynamic table stay: the bindings and the libraries resolve through them
            subprocess.run(["strip", "--strip-unneeded", "-o", str(dst), str(entry)], check=True)
            files[entry.name] = sha256_file(dst)
            unpacked += dst.stat().st_size
        with tarfile.open(out / LIBS_ARCHIVE, "w:xz") as tar:
            for entry in entries:
                tar.add(staged / entry.name, arcname=entry.name)
    manifest = Manifest(key=key, config=asdict(cfg), files=files, links=links,
                        archive_bytes=(out / LIBS_ARCHIVE).stat().st_size, unpacked_bytes=unpacked,
                        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (out / MANIFEST).write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    return manifest


def check(bundle: Path, cfg: BuildConfig) -> Manifest:
    """The bundle's manifest, if it was built from exactly the sources here; else BuildError."""
    manifest = Manifest.read(bundle)
    want = build_key(cfg)
    if manifest.key != want:
        raise BuildError(f"stale device bundle in {bundle}: it holds build {manifest.key}, the sources "
                         f"here are {want} (patches/, native/ or CMakeLists.txt changed); "
                         "rerun bench/device/prepare.sh")
    return manifest


def unpack(bundle: Path, dest: Path, cfg: BuildConfig) -> Path:
    """Check the bundle against the sources, extract its libraries into ``dest`` and verify them."""
    manifest = check(bundle, cfg)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(bundle / LIBS_ARCHIVE, "r:xz") as tar:
        tar.extractall(dest, filter="data")
    for name, digest in manifest.files.items():
        path = dest / name
        if not path.is_file() or sha256_file(path) != digest:
            raise BuildError(f"device bundle {bundle}: {name} is missing or corrupt after unpacking")
    for name in manifest.links:
        if not (dest / name).is_file():
            raise BuildError(f"device bundle {bundle}: link {name} does not resolve after unpacking")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m saem_gguf.build.bundle",
                                 description="Pack, check or unpack the prebuilt device bundle.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("pack", "check", "unpack"):
        p = sub.add_parser(name)
        p.add_argument("--cuda-arch", default="90", help="CUDA architecture of the build (90)")
        p.add_argument("--cpu", action="store_true",
                       help="this machine's CPU build instead (the device run's --dry-run)")
        if name == "pack":
            p.add_argument("--lib", type=Path, required=True, help="directory of the built libraries")
            p.add_argument("--out", type=Path, required=True, help="bundle directory (.device)")
        else:
            p.add_argument("--bundle", type=Path, required=True, help="bundle directory (.device)")
        if name == "unpack":
            p.add_argument("--dest", type=Path, required=True, help="where the libraries go")
    args = ap.parse_args(argv)
    cfg = BuildConfig() if args.cpu else device_config(args.cuda_arch)
    try:
        if args.cmd == "pack":
            m = pack(args.lib, args.out, cfg)
            print(f"packed {len(m.files)} libraries, build {m.key}: {m.archive_bytes / 2**20:.1f} MiB "
                  f"({m.unpacked_bytes / 2**20:.1f} MiB unpacked)")
        elif args.cmd == "check":
            print(check(args.bundle, cfg).key)
        else:
            print(unpack(args.bundle, args.dest, cfg))
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
