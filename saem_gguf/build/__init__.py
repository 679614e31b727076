"""Build of the patched llama.cpp: fetch the sdist, patch it, compile it once, cache the result."""

from saem_gguf.build.builder import BuildConfig, build, find_build, library_dir

__all__ = ["BuildConfig", "build", "find_build", "library_dir"]
