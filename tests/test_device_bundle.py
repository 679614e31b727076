"""The device bundle (saem_gguf.build.bundle): packs the build of the current sources, unpacks it
bit-identical, and refuses a bundle built from other sources, or a library that is not the build."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from saem_gguf.build import BuildConfig, find_build
from saem_gguf.build.builder import build_key
from saem_gguf.build.bundle import MANIFEST, check, device_config, pack, unpack
from saem_gguf.build.source import sha256_file
from saem_gguf.errors import BuildError

CPU = BuildConfig()


@pytest.fixture(scope="module")
def lib_dir():
    lib = find_build(CPU)
    assert lib is not None, "the CPU build of the current sources must exist (bash setup.sh)"
    return lib


@pytest.fixture(scope="module")
def bundle(lib_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle")
    pack(lib_dir, out, CPU)
    return out


def test_pack_records_the_key_and_unpacks_identical_stripped_libraries(bundle, lib_dir, tmp_path):
    manifest = check(bundle, CPU)
    assert manifest.key == build_key(CPU)
    assert {"libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so"} <= set(manifest.links)
    dest = unpack(bundle, tmp_path / "lib", CPU)
    for name in ("libllama.so", "libggml-cpu.so"):
        unpacked, built = (dest / name).resolve(), (lib_dir / name).resolve()
        assert unpacked.name == built.name  # same soname chain
        assert sha256_file(unpacked) == manifest.files[unpacked.name]
        assert unpacked.stat().st_size <= built.stat().st_size  # stripped
    # the unpacked libllama loads and reports our native layer, in a fresh process
    probe = ("import ctypes,sys; l=ctypes.CDLL(sys.argv[1]); f=l.saem_native_version; "
             "f.restype=ctypes.c_char_p; print(f().decode())")
    r = subprocess.run([sys.executable, "-c", probe, str(dest / "libllama.so")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("saem-native "), r.stderr


def test_stale_bundle_is_refused(bundle, tmp_path):
    manifest = json.loads((bundle / MANIFEST).read_text())
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / MANIFEST).write_text(json.dumps({**manifest, "key": "saem-cpu-0000000000000000"}))
    with pytest.raises(BuildError, match="stale device bundle"):
        check(stale, CPU)
    with pytest.raises(BuildError, match="stale device bundle"):
        unpack(stale, tmp_path / "lib", CPU)
    assert not (tmp_path / "lib").exists()  # refused before anything is written
    r = subprocess.run([sys.executable, "-m", "saem_gguf.build.bundle", "check", "--cpu", "--bundle",
                        str(stale)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("error: stale device bundle"), r.stderr
    assert "Traceback" not in r.stderr


def test_bundle_of_another_config_is_refused(bundle):
    with pytest.raises(BuildError, match="stale device bundle"):
        check(bundle, device_config("90"))  # a CPU bundle is not the CUDA build


def test_pack_refuses_a_library_that_is_not_the_build(lib_dir, tmp_path):
    with pytest.raises(BuildError, match="is not the build"):
        pack(lib_dir, tmp_path / "b", device_config("90"))
    with pytest.raises(BuildError, match="is not the build"):
        pack(tmp_path, tmp_path / "b", CPU)


def test_missing_or_corrupt_bundle(bundle, tmp_path):
    with pytest.raises(BuildError, match="holds no device bundle"):
        check(tmp_path, CPU)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / MANIFEST).write_text("{not json")
    with pytest.raises(BuildError, match="not a device bundle manifest"):
        check(broken, CPU)


def test_link_check_of_the_build_and_of_an_incomplete_set(lib_dir, tmp_path):
    from saem_gguf.build import link_check

    rep = link_check.check(lib_dir)
    assert rep.ok, (rep.libraries, rep.missing)
    assert rep.native_symbols >= 25 and rep.binding_symbols > 200
    # libllama without the library it needs: ldd -r complains, and our API is missing
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy((lib_dir / "libllama.so").resolve(), part / "libllama.so")
    rep = link_check.check(part)
    assert not rep.ok and "not found" in rep.libraries["libllama.so"]
    assert not any(m.startswith("saem_") for m in rep.missing)  # libllama itself exports them
    r = subprocess.run([sys.executable, "-m", "saem_gguf.build.link_check", str(part)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "error: the library set does not link completely" in r.stderr
