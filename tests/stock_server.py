"""Stock llama-server, built from the same verified llama-cpp-python sdist as the stock library
(no patches), for the tests that compare `serve` with it. Built once into the cache (about 4 min
on 2 cores: ggml, llama, common and the server) and reused; started on a free port."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx

from saem_gguf.build.paths import cache_root
from saem_gguf.build.source import fetch_sdist, prepare_source, sha256_file

# the server alone: no tests, examples, web UI download, HTTPS or curl (no network where it runs)
CMAKE_ARGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
              "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]


def llama_server() -> Path:
    """The stock llama-server binary, built if needed."""
    sdist = fetch_sdist(quiet=True)
    key = hashlib.sha256((sha256_file(sdist) + " ".join(CMAKE_ARGS)).encode()).hexdigest()[:16]
    work = cache_root() / "work" / f"stock-server-{key}"
    binary, done = work / "build" / "bin" / "llama-server", work / "built"
    if done.exists() and binary.exists():
        return binary
    if work.exists():
        shutil.rmtree(work)
    src = prepare_source(work / "llama.cpp", [], sdist)
    log = work / "build.log"
    with log.open("w") as out:
        for cmd in (["cmake", "-S", str(src), "-B", str(work / "build"), *CMAKE_ARGS],
                    ["cmake", "--build", str(work / "build"), "--target", "llama-server",
                     "-j", str(os.cpu_count() or 2)]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"building stock llama-server failed: {log}")
    done.write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class StockServer:
    """A running stock llama-server."""

    proc: subprocess.Popen
    url: str

    @classmethod
    def start(cls, model: Path, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> StockServer:
        port = free_port()
        proc = subprocess.Popen([str(llama_server()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                                 "-t", "1", "--no-webui", *args],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"stock llama-server exited ({proc.returncode})")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return cls(proc, url)
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        proc.kill()
        raise RuntimeError("stock llama-server did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
