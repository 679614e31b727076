"""GGUF fuzzer: seeded, structure-aware mutations of real generated models, and a load worker.

Mutations target every part of the format: the header (version, counts), metadata (values, value
types, string/array lengths), tensor infos (dimension counts, dimensions, types, data offsets) and
tensor data. Each mutant goes through ``inspect`` in-process and through a real llama.cpp load (the
engine: our checks, then llama.cpp, then a short generation) in a worker subprocess that reports
one outcome per file; a worker that dies (abort, segfault) or stops answering is recorded as a
crash or hang for that file and restarted.

    python tests/gguf_fuzz.py --worker          # reads mutant paths on stdin, one per line
    python tests/gguf_fuzz.py --loads 200 --seed 1   # a stand-alone run; prints the outcome counts
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import random
import select
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# outcomes a mutant can have; the last three are failures
CLEAN = ("ok", "rejected", "load_error")
FAILURES = ("traceback", "crash", "hang")
LOAD_TIMEOUT_S = 60.0
WORKER_ADDRESS_SPACE = 8 << 30


# --- where things are in a GGUF ----------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """Bytes of the file a mutation may rewrite: what they hold and how they are encoded."""
    kind: str  # header | kv_value | kv_type | length | n_dims | dim | tensor_type | offset | data
    offset: int
    fmt: str  # struct format of one value ("<I", "<Q", "<f", ...), "" for raw data
    name: str = ""


def _file_offset(part: np.ndarray, base: np.ndarray) -> int:
    return part.__array_interface__["data"][0] - base.__array_interface__["data"][0]


_NUMERIC_FMT = {np.dtype(np.uint8): "<B", np.dtype(np.int8): "<b", np.dtype(np.uint16): "<H",
                np.dtype(np.int16): "<h", np.dtype(np.uint32): "<I", np.dtype(np.int32): "<i",
                np.dtype(np.float32): "<f", np.dtype(np.bool_): "<B", np.dtype(np.uint64): "<Q",
                np.dtype(np.int64): "<q", np.dtype(np.float64): "<d"}


def mutation_slots(path: Path) -> list[Slot]:
    """Every mutable place of a GGUF, found with the gguf package's reader."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    base = r.data
    slots = [Slot("header", 4, "<I", "version"), Slot("header", 8, "<Q", "n_tensors"),
             Slot("header", 16, "<Q", "n_kv")]
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        klen, _kdata, vtype, *values = f.parts
        slots.append(Slot("length", _file_offset(klen, base), "<Q", f.name + " (key length)"))
        slots.append(Slot("kv_type", _file_offset(vtype, base), "<I", f.name))
        for i, part in enumerate(values):
            if part.dtype == np.uint64 and (i == 0 and len(values) > 1 or part.size == 1 and
                                            i + 1 < len(values) and values[i + 1].dtype == np.uint8):
                # an array's element count or a string's byte length
                slots.append(Slot("length", _file_offset(part, base), "<Q", f.name))
            elif part.dtype in _NUMERIC_FMT and part.dtype != np.uint8:
                # the first few numbers of an array are enough; scalars always
                slots.append(Slot("kv_value", _file_offset(part, base), _NUMERIC_FMT[part.dtype], f.name))
            if i > 8:
                break
    for t in r.tensors:
        _nl, _nd, n_dims, dims, ttype, toff = t.field.parts
        slots.append(Slot("n_dims", _file_offset(n_dims, base), "<I", t.name))
        for j in range(len(dims)):
            slots.append(Slot("dim", _file_offset(dims, base) + 8 * j, "<Q", t.name))
        slots.append(Slot("tensor_type", _file_offset(ttype, base), "<I", t.name))
        slots.append(Slot("offset", _file_offset(toff, base), "<Q", t.name))
        slots.append(Slot("data", int(t.data_offset), "", t.name))
    return slots


def _special_values(fmt: str, old, rng: random.Random) -> list:
    if fmt in ("<f", "<d"):
        return [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 1e-30, 1e30, -old if old else 1.0]
    bits = struct.calcsize(fmt) * 8
    signed = fmt[1].islower()
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    cands = [0, 1, 2, 3, 7, hi, lo, hi // 2 + 1, old + 1, old - 1, old * 2, old // 2,
             rng.randint(lo, hi), rng.randint(0, 64)]
    return [v for v in cands if lo <= v <= hi]


def mutate(data: bytes, slots: list[Slot], rng: random.Random) -> tuple[bytes, str]:
    """One mutant of ``data``: 1-3 slot rewrites (or a truncation); returns (bytes, description)."""
    buf = bytearray(data)
    notes = []
    if rng.random() < 0.05:
        cut = rng.randint(0, len(buf) - 1)
        return bytes(buf[:cut]), f"truncated at {cut}"
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        s = rng.choice(slots)
        if s.kind == "data":
            end = min(len(buf), s.offset + 64)
            for _ in range(rng.randint(1, 8)):
                if s.offset < end:
                    buf[rng.randrange(s.offset, end)] = rng.choice((0x00, 0xFF, 0x7F, 0xC0, rng.randrange(256)))
            notes.append(f"data of {s.name}")
            continue
        size = struct.calcsize(s.fmt)
        if s.offset + size > len(buf):
            continue
        old = struct.unpack_from(s.fmt, buf, s.offset)[0]
        if s.kind in ("kv_type", "tensor_type"):
            new = rng.choice((rng.randint(0, 13), rng.randint(0, 41), 0xFFFFFFFF, old + 1))
        else:
            new = rng.choice(_special_values(s.fmt, old, rng))
        struct.pack_into(s.fmt, buf, s.offset, new)
        notes.append(f"{s.kind} {s.name}: {old!r} -> {new!r}")
    return bytes(buf), "; ".join(notes)


# --- outcomes ------------------------------------------------------------------------------------
def inspect_outcome(path: Path) -> tuple[str, str]:
    """``inspect PATH`` in-process: ok, rejected (one error line) or traceback (anything else)."""
    from saem_gguf.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["inspect", str(path)])
        except BaseException as e:  # noqa: BLE001 - everything that escapes main is a finding
            return "traceback", f"{type(e).__name__}: {e}"
    return classify(rc, err.getvalue())


def classify(rc: int, stderr: str) -> tuple[str, str]:
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("[saem]")]
    if rc == 0:
        return "ok", ""
    if rc == 1 and len(lines) == 1 and lines[0].startswith("error: ") and "internal error" not in lines[0]:
        kind = "load_error" if "llama.cpp could not load" in lines[0] else "rejected"
        return kind, lines[0]
    return "traceback", stderr.strip()[-500:]


def worker() -> int:
    """Load each path read from stdin through the engine (our checks, llama.cpp, 4 greedy tokens);
    answer one JSON line per path. Runs until stdin closes."""
    import resource

    from saem_gguf.cli.main import build_parser, run_command

    # a runaway allocation fails here instead of waking the kernel's OOM killer on a shared machine
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_SPACE, WORKER_ADDRESS_SPACE))
    # answers go to a private copy of stdout; fd 1 itself (where C code may print) goes nowhere
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    parser = build_parser()
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        args = parser.parse_args(["generate", "-m", path, "-p", "Wait, check it", "-n", "4",
                                  "-c", "128", "-t", "1", "--quiet", "--json"])
        err = io.StringIO()
        out = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                rc = run_command(args)
            except BaseException as e:  # noqa: BLE001
                rc, err = 99, io.StringIO(f"{type(e).__name__}: {e}")
        outcome, detail = classify(rc, err.getvalue())
        print(json.dumps({"path": path, "outcome": outcome, "detail": detail[:300]}), file=answers,
              flush=True)
    return 0


class LoadWorkers:
    """A worker subprocess, restarted when it crashes or hangs."""

    def __init__(self, timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=env)
        self.starts += 1
        if self._read_line(120.0) is None:
            raise RuntimeError("fuzz worker did not start")

    def _read_line(self, timeout: float) -> str | None:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        return self.proc.stdout.readline() or None

    def load(self, path: Path) -> tuple[str, str]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        line = self._read_line(self.timeout_s)
        if line is None:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
                return "hang", f"no answer in {self.timeout_s:.0f} s"
            return "crash", f"worker died with {self.proc.returncode}"
        ans = json.loads(line)
        return ans["outcome"], ans["detail"]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class FuzzReport:
    inspect: collections.Counter
    load: collections.Counter
    findings: list[str]
    worker_starts: int
    seconds: float

    def failures(self) -> int:
        return sum(self.inspect[k] + self.load[k] for k in FAILURES)

    def summary(self) -> str:
        return (f"inspect: {dict(self.inspect)}; load: {dict(self.load)}; "
                f"worker starts {self.worker_starts}; {self.seconds:.0f} s")


def base_models() -> list[Path]:
    """The fuzzed originals: three architectures and quant families (cached generated models)."""
    from saem_gguf.testmodels import ModelSpec, ensure_model

    return [ensure_model(ModelSpec(arch="qwen3moe", expert_type="q4_0")),
            ensure_model(ModelSpec(arch="qwen2moe", expert_type="q8_0")),
            ensure_model(ModelSpec(arch="llama", expert_type="f16", n_expert=4))]


def run_fuzz(n_inspect: int, n_load: int, seed: int, workdir: Path) -> FuzzReport:
    """``n_inspect`` mutants through in-process inspect, the first ``n_load`` of them also through
    a llama.cpp load in the worker."""
    rng = random.Random(seed)
    originals = [(p.read_bytes(), mutation_slots(p)) for p in base_models()]
    inspect_counts: collections.Counter = collections.Counter()
    load_counts: collections.Counter = collections.Counter()
    findings: list[str] = []
    workers = LoadWorkers()
    t0 = time.time()
    path = workdir / "mutant.gguf"
    try:
        for i in range(max(n_inspect, n_load)):
            data, slots = originals[i % len(originals)]
            mutant, what = mutate(data, slots, rng)
            path.write_bytes(mutant)
            if i < n_inspect:
                outcome, detail = inspect_outcome(path)
                inspect_counts[outcome] += 1
                if outcome in FAILURES:
                    findings.append(f"inspect #{i} ({what}): {outcome}: {detail}")
            if i < n_load:
                outcome, detail = workers.load(path)
                load_counts[outcome] += 1
                if outcome in FAILURES:
                    keep = workdir / f"finding-{i}.gguf"
                    keep.write_bytes(mutant)
                    findings.append(f"load #{i} ({what}): {outcome}: {detail} [{keep}]")
    finally:
        workers.close()
    return FuzzReport(inspect_counts, load_counts, findings, workers.starts, time.time() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help="run as the load worker")
    ap.add_argument("--inspect", type=int, default=2000, help="mutants through inspect (2000)")
    ap.add_argument("--loads", type=int, default=200, help="mutants through a llama.cpp load (200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None, help="where mutants and findings go")
    a = ap.parse_args()
    if a.worker:
        return worker()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-") as tmp:
        wd = a.workdir or Path(tmp)
        wd.mkdir(parents=True, exist_ok=True)
        rep = run_fuzz(a.inspect, a.loads, a.seed, wd)
    print(rep.summary())
    for f in rep.findings[:50]:
        print(f)
    return 1 if rep.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
