"""The library in use is our patched build, and the build cache behaves."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from saem_gguf.build import BuildConfig, build, find_build
from saem_gguf.build.builder import build_key
from saem_gguf.build.paths import cache_root
from saem_gguf.build.source import LLAMA_CPP_COMMIT, apply_patches, fetch_sdist, extract_llama_cpp
from saem_gguf.errors import BuildError


def test_patched_library_is_loaded(llama_cpp):
    from saem_gguf import native_api

    v = native_api.saem_native_version()
    assert v.startswith("saem-native ") and LLAMA_CPP_COMMIT in v
    assert native_api.saem_native_abi_version() == native_api.ABI_VERSION
    lib_dir = find_build(BuildConfig())
    assert lib_dir is not None and str(lib_dir) == str(llama_cpp.llama_cpp._base_path)
    # the library llama-cpp-python uses is the one native_api found the symbol in
    assert llama_cpp.llama_cpp._lib._name.startswith(str(lib_dir))


def test_unchanged_rebuild_is_a_cache_hit(monkeypatch):
    lib = find_build(BuildConfig())
    assert lib is not None

    def no_subprocess(*a, **k):
        raise AssertionError("an unchanged rebuild must not run a build step")

    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert build(BuildConfig(), quiet=True) == lib


def test_a_portable_build_names_its_instruction_sets():
    """GGML_NATIVE=OFF alone leaves ggml's per-instruction-set options to whatever the CMake tree's
    cache holds (OFF after a native configure: a scalar library); the builder sets them."""
    from saem_gguf.build.builder import portable_isa_args

    args = BuildConfig(native_cpu=False).cmake_args()
    assert "-DGGML_NATIVE=OFF" in args
    if portable_isa_args():  # an x86-64 host
        assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF"} <= set(args)
    assert not any(a.startswith("-DGGML_AVX") for a in BuildConfig().cmake_args())
    assert portable_isa_args("aarch64") == [] and "-DGGML_AVX2=ON" in portable_isa_args("x86_64")


def test_build_key_tracks_inputs():
    a = build_key(BuildConfig())
    assert a == build_key(BuildConfig())
    assert a != build_key(BuildConfig(cuda=True))
    assert a != build_key(BuildConfig(variant="stock"))
    assert a != build_key(BuildConfig(build_type="Debug"))


def test_sdist_is_verified_and_a_bad_patch_is_named(tmp_path):
    sdist = fetch_sdist(quiet=True)  # cached by setup; verifies the sha256 again
    tree = tmp_path / "llama.cpp"
    tree.mkdir()
    extract_llama_cpp(sdist, tree)
    assert (tree / "src" / "llama-graph.cpp").exists()
    bad = tmp_path / "9999-bad.patch"
    bad.write_text("# a patch that cannot apply\n--- a/src/llama.cpp\n+++ b/src/llama.cpp\n"
                   "@@ -1,1 +1,1 @@\n-this line is not in the file\n+nor is this one\n")
    with pytest.raises(BuildError, match="9999-bad.patch does not apply"):
        apply_patches(tree, [bad])
