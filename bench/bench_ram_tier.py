"""The RAM tier against stock llama.cpp's plain mmap, under a real memory limit (issue 15).

    python bench/bench_ram_tier.py --model BIG.gguf [--fractions 25,50,75] [--reps 3] [--json OUT]
    python bench/bench_ram_tier.py --generate /work/bigmodels/x.gguf ...   # write the model first

Every configuration runs in its own process inside its own memory cgroup (v1 ``memory`` at
/sys/fs/cgroup/memory, or v2 with the memory controller), after the model file's pages are dropped
from the page cache (``posix_fadvise(DONTNEED)``, checked with ``mincore``). The cgroup limit of a
budget fraction f is ``--overhead`` (the process: Python, NumPy, Numba, llama.cpp's compute
buffers) + the non-expert weights + the KV cache + f x the expert bytes + ``--margin``; stock
llama.cpp gets the same limit for the same f, so both have the same memory and the difference is
who decides what stays in it. Each child decodes the same teacher-forced reasoning text (``--replay``
style: held-out examples of the embedded model's corpus, stage cues included) one token at a
time after its prompt, and records per step the greedy token (argmax of the logits): identical
sequences mean identical greedy output. Measured over the decode only: tokens/s, bytes read from
disk (/proc/self/io read_bytes, all threads), major faults (getrusage, all threads); the cgroup's
peak usage over the whole run. Configurations:

* ``stock``: stock llama-cpp-python on the stock llama.cpp build (``build --variant stock``),
  plain mmap (llama.cpp's ``--no-repack``: its default repacks Q4_0 experts into anonymous memory
  on this CPU, which no limit below the model size survives), the kernel's page cache decides;
* ``no-mmap``: stock without mmap, only if the whole model fits the limit (it never does when
  the model is at least twice the limit; reported as skipped);
* ``tier:<policy>``: saem_gguf with the experts on the CPU (``--policy cpu-moe``: no VRAM tier on
  a CPU machine) and ``--ram-budget`` f x expert bytes under ``--ram-policy <policy>``;
  ``+thread``: ``--ram-prefetch thread``; ``-noroute``: ``--no-ram-route-prefetch``.

A preparation step (its own process, no limit) tokenizes the texts and writes a calibration
profile whose expert counts come from a prefill of *other* held-out examples (static-hot and the
saem family rank by them), so no configuration is calibrated on the text it is timed on.
Needs root (cgroups); without it the script says so and exits 0. Heavy: run it under the
project's lock (`flock /tmp/saem-heavy.lock nice -n 5 ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from saem_gguf.cli.arg_types import output_file  # noqa: E402
from saem_gguf.cli.script import run_script  # noqa: E402
from saem_gguf.fileio import write_text_atomic  # noqa: E402
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
POLICIES = ("lru-cpu", "lfu-cpu", "static-hot", "saem")
# The bench model: Qwen3-30B-A3B's layer shape (hidden 2048, expert FFN 768, 128 experts, top-8,
# 32 query / 4 KV heads) with 16 of its 48 layers, Q4_0 experts, stage-planted routing: 5.4 GiB.
GEN_FLAGS = ["--arch", "qwen3moe", "--expert-type", "q4_0", "--layers", "16", "--embd", "2048", "--ff", "768",
             "--experts", "128", "--top-k", "8", "--heads", "32", "--kv-heads", "4", "--head-dim", "64",
             "--stage-routing", "--expert-pool", "16"]
N_CTX = 1024


# --- cgroups ------------------------------------------------------------------------------------
class MemoryCgroup:
    """One memory cgroup with a hard limit, v1 or v2; the child joins it before it execs."""

    def __init__(self, name: str, limit: int) -> None:
        if (CGROUP_V1 / "memory.limit_in_bytes").exists():
            self.v2 = False
            self.path = CGROUP_V1 / name
        else:
            self.v2 = True
            self.path = CGROUP_V2 / name
        self.path.mkdir(exist_ok=True)
        if self.v2:
            (self.path / "memory.max").write_text(str(limit))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        self.limit = limit

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run by a shell that first moves itself into the cgroup (then execs)."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh", *argv]

    def peak(self) -> int:
        f = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / f).read_text())
        except (OSError, ValueError):
            return -1

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def cgroups_usable() -> str | None:
    """None if this process can make memory cgroups, else why not."""
    if os.geteuid() != 0:
        return "needs root to create memory cgroups"
    if (CGROUP_V1 / "memory.limit_in_bytes").exists():
        return None if os.access(CGROUP_V1, os.W_OK) else f"{CGROUP_V1} is not writable"
    ctrl = CGROUP_V2 / "cgroup.controllers"
    if ctrl.exists() and "memory" in ctrl.read_text().split():
        return None if os.access(CGROUP_V2, os.W_OK) else f"{CGROUP_V2} is not writable"
    return "no cgroup memory controller (v1 /sys/fs/cgroup/memory or v2 with memory)"


# --- page cache ---------------------------------------------------------------------------------
def drop_file_cache(path: Path) -> float:
    """Drop the file's clean pages from the page cache; returns the fraction still resident."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return -1.0
        try:
            vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
            if libc.mincore(addr, size, vec) != 0:
                return -1.0
            return sum(bytes(vec)) / len(vec)  # mincore writes 1 (resident) or 0 per page
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def probe_prefetch(model: Path, n: int = 20, expert_bytes: int = 2654208) -> list[dict]:
    """Ways to read a cold expert-sized range of ``model``, timed: page faults as llama.cpp's
    mapping takes them (POSIX_FADV_SEQUENTIAL on the file, as llama.cpp sets it), faults after
    MADV_RANDOM, MADV_WILLNEED on the exact range then touch, MADV_POPULATE_READ. ``n`` ranges
    37 experts apart from 1 GiB in, the file's pages dropped before each way."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size = model.stat().st_size
    span = expert_bytes // mmap.PAGESIZE * mmap.PAGESIZE
    offsets = [(1 << 30) + i * 37 * span for i in range(n)]
    if offsets[-1] + span > size:
        raise SystemExit(f"error: {model} is too small for the probe")
    fd = os.open(model, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    madv_random, madv_willneed, madv_dontneed, madv_populate_read = 1, 3, 4, 22

    def touch(off: int) -> None:
        for p in range(off, off + span, mmap.PAGESIZE):
            ctypes.c_ubyte.from_address(base + p).value

    ways = {"page faults (stock)": lambda off: touch(off),
            "page faults after MADV_RANDOM": lambda off: (libc.madvise(base + off, span, madv_random), touch(off)),
            "MADV_WILLNEED, then touch": lambda off: (libc.madvise(base + off, span, madv_willneed), touch(off)),
            "MADV_POPULATE_READ": lambda off: libc.madvise(base + off, span, madv_populate_read)}
    out = []
    try:
        for name, way in ways.items():
            libc.madvise(base, size, madv_dontneed)  # unmap ours, so the fadvise can drop the pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            io0, t0 = _io_read_bytes(), time.perf_counter()
            for off in offsets:
                way(off)
            dt = time.perf_counter() - t0
            out.append({"way": name, "ms_per_expert": dt / n * 1e3, "mb_read_per_expert": (_io_read_bytes() - io0) / n / 1e6})
            libc.madvise(base, size, 0)  # MADV_NORMAL again
    finally:
        libc.munmap(base, size)
        os.close(fd)
    return out


# --- children -----------------------------------------------------------------------------------
def _io_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _decode(llm, llama_cpp, prompt: list[int], text: list[int]) -> dict:
    """Evaluate ``prompt``, then ``text`` one token at a time, timing the decode only; per step
    the argmax of the logits (the greedy token)."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    n_vocab = llm.n_vocab()
    greedy = []
    io0, ru0 = _io_read_bytes(), resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for tok in text:
        llm.eval([tok])
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        greedy.append(int(np.argmax(logits)))
    seconds = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"tokens": len(text), "seconds": seconds, "tok_s": len(text) / seconds,
            "read_bytes": _io_read_bytes() - io0, "major_faults": ru1.ru_majflt - ru0.ru_majflt,
            "greedy": greedy}


def child(job: dict) -> dict:
    texts = job["texts"]
    t0 = time.perf_counter()
    if job["kind"] in ("stock", "no-mmap"):
        import llama_cpp  # the stock library: LLAMA_CPP_LIB_PATH points at it, saem_gguf is not imported

        class PlainLlama(llama_cpp.Llama):
            """llama.cpp's --no-repack: by default this CPU repacks Q4_0 weights into anonymous
            memory (CPU_REPACK), a copy of every expert that no mmap backs (OOM-killed here)."""

            @property
            def model_params(self):
                return self._plain_params

            @model_params.setter
            def model_params(self, params) -> None:
                params.use_extra_bufts = False
                self._plain_params = params

        llm = PlainLlama(model_path=job["model"], n_ctx=N_CTX, n_threads=job["threads"],
                         n_threads_batch=job["threads"], use_mmap=job["kind"] == "stock", verbose=False)
        library = llama_cpp.llama_cpp._lib._name
        notes, extra = [], {}
        load_s = time.perf_counter() - t0
        runs = [_decode(llm, llama_cpp, t["prompt"], t["text"]) for t in texts]
    else:
        sys.path.insert(0, str(REPO))
        from saem_gguf.engine import Engine, EngineConfig

        notes = []
        eng = Engine(EngineConfig(model=Path(job["model"]), n_ctx=N_CTX, n_threads=job["threads"], policy="cpu-moe",
                                  ecr=0.0, hw=job["hw"], profile=Path(job["profile"]), ram_budget=job["ram_budget"],
                                  ram_policy=job["policy"], ram_prefetch=job["prefetch"],
                                  ram_route_prefetch=job["route_prefetch"], progress=False),
                     log=notes.append)
        load_s = time.perf_counter() - t0
        if eng.ram_tier is None:
            raise SystemExit("error: the RAM tier did not start: " + " / ".join(notes))
        library = eng._llama_cpp.llama_cpp._lib._name
        runs = []
        for t in texts:
            eng.reset_sequence()
            runs.append(_decode(eng.llm, eng._llama_cpp, t["prompt"], t["text"]))
        st = eng.ram_tier.stats
        extra = {"ram_hit_rate": st.hit_rate, "ram_prefetched": st.prefetched, "ram_released": st.released,
                 "release_advice": eng.ram_tier.release_name, "slots": eng.ram_tier.budget.slots}
    total = {k: sum(r[k] for r in runs) for k in ("tokens", "seconds", "read_bytes", "major_faults")}
    return {"library": library, "load_s": load_s, "notes": notes, **extra, **total,
            "tok_s": total["tokens"] / total["seconds"], "greedy": [g for r in runs for g in r["greedy"]]}


# --- preparation --------------------------------------------------------------------------------
def prepare(model: Path, out: Path, n_texts: int, max_tokens: int, threads: int) -> dict:
    """Tokens of the timed texts and a calibration profile from other held-out texts (own process)."""
    sys.path.insert(0, str(REPO))
    import numpy as np

    from saem_gguf import native_api as na
    from saem_gguf.defaultmodel.corpus import heldout_examples
    from saem_gguf.engine import Engine, EngineConfig
    from saem_gguf.gguf_info import compute_buffer_bytes, kv_cache_bytes, read_model_info
    from saem_gguf.stage.calibrate import Profile
    from saem_gguf.stage.cues import CueSet

    eng = Engine(EngineConfig(model=model, n_ctx=N_CTX, n_threads=threads, policy="cpu-moe", ecr=0.0,
                              hw="rtx3060-ddr4", progress=False))
    try:
        texts = []
        for ex in heldout_examples(n_texts, seed=7):
            prompt = eng.prompt_tokens(ex.prompt, parse_special=True)
            text = eng.llm.tokenize(ex.completion.encode(), add_bos=False, special=True)[:max_tokens]
            texts.append({"prompt": prompt, "text": text})
        calib = [eng.prompt_tokens(ex.prompt + ex.completion, parse_special=True)
                 for ex in heldout_examples(8, seed=1234)]
        na.saem_moe_reset_counts(eng.llm)
        for toks in calib:
            eng.llm.reset()
            eng.llm.eval(toks[:N_CTX - 1])
        counts = np.array([na.saem_moe_get_counts(eng.llm, il) for il in eng.placement.moe_layers], np.int64)
        prof = Profile(eng.signature(), CueSet.load("qwen3"), {"min_stage_tokens": 32},
                       stats={"expert_counts": counts.tolist()})
        profile = out.with_suffix(".profile.json")
        prof.save(profile)
        info = read_model_info(model)
    finally:
        eng.close()
    return {"texts": texts, "profile": str(profile), "expert_bytes": info.expert_bytes,
            "non_expert_bytes": info.non_expert_bytes, "kv_bytes": kv_cache_bytes(info, N_CTX),
            "compute_bytes": compute_buffer_bytes(info), "model_bytes": model.stat().st_size,
            "calib_tokens": int(sum(min(len(t), N_CTX - 1) for t in calib))}


# --- parent -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    kind: str  # stock | no-mmap | tier
    fraction: float
    policy: str = ""
    prefetch: str = "madvise"
    route_prefetch: bool = True

    @property
    def label(self) -> str:
        if self.kind != "tier":
            return self.kind
        return (f"tier:{self.policy}" + ("" if self.prefetch == "madvise" else f"+{self.prefetch}")
                + ("" if self.route_prefetch else "-noroute"))


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def run_config(cfg: Config, prep: dict, args, stock_lib: Path) -> dict:
    fixed = args.overhead + prep["non_expert_bytes"] + prep["kv_bytes"] + prep["compute_bytes"]
    budget = int(cfg.fraction * prep["expert_bytes"])
    limit = fixed + budget + args.margin
    if cfg.kind == "no-mmap" and prep["model_bytes"] + fixed > limit:
        return {"skipped": f"--no-mmap reads the whole model ({_gib(prep['model_bytes'])}) into anonymous "
                           f"memory: it does not fit the {_gib(limit)} limit"}
    resident = drop_file_cache(args.model)
    job = {"kind": cfg.kind, "model": str(args.model), "threads": args.threads, "texts": prep["texts"],
           "profile": prep["profile"], "hw": args.hw, "ram_budget": budget, "policy": cfg.policy,
           "prefetch": cfg.prefetch, "route_prefetch": cfg.route_prefetch}
    env = dict(os.environ)
    if cfg.kind != "tier":
        env["LLAMA_CPP_LIB_PATH"] = str(stock_lib)
    env["PYTHONPATH"] = str(REPO)
    cg = MemoryCgroup(f"saem-ramtier-{os.getpid()}", limit)
    try:
        t0 = time.perf_counter()
        r = subprocess.run(cg.wrap([sys.executable, __file__, "--child"]), input=json.dumps(job),
                           capture_output=True, text=True, env=env, timeout=args.child_timeout)
        wall = time.perf_counter() - t0
        peak = cg.peak()
    finally:
        cg.remove()
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1], "limit": limit}
    out = json.loads(r.stdout)
    out.update(limit=limit, budget=budget, peak=peak, wall_s=wall, resident_before=resident,
               loadavg=os.getloadavg()[0])
    return out


def summarise(results: dict, configs: list[Config], fractions: list[float]) -> tuple[list[str], list[dict]]:
    lines = ["| RAM budget | config | cgroup limit | decode tok/s (mean ± sd) | vs stock | disk read MB/token | "
             "major faults/token | peak cgroup | RAM hit rate | same greedy output as stock |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    rows = []
    for f in fractions:
        stock = results.get((Config("stock", f).label, f), [])
        stock_ok = [r for r in stock if "tok_s" in r]
        stock_mean = statistics.mean(r["tok_s"] for r in stock_ok) if stock_ok else None
        for cfg in [c for c in configs if c.fraction == f]:
            reps = results.get((cfg.label, f), [])
            ok = [r for r in reps if "tok_s" in r]
            if not ok:
                why = next((r.get("skipped") or r.get("error") for r in reps), "not run")
                lines.append(f"| {f:.0%} | {cfg.label} | | {why} | | | | | | |")
                rows.append({"fraction": f, "config": cfg.label, "skipped": why})
                continue
            tps = [r["tok_s"] for r in ok]
            mean, sd = statistics.mean(tps), statistics.stdev(tps) if len(tps) > 1 else 0.0
            toks = sum(r["tokens"] for r in ok)
            mb_tok = sum(r["read_bytes"] for r in ok) / toks / 1e6
            flt_tok = sum(r["major_faults"] for r in ok) / toks
            ratio = mean / stock_mean if stock_mean else float("nan")
            same = all(r["greedy"] == s["greedy"] for r in ok for s in stock_ok) if stock_ok else None
            hit = statistics.mean(r["ram_hit_rate"] for r in ok) if "ram_hit_rate" in ok[0] else None
            peak = max(r["peak"] for r in ok)
            lines.append(f"| {f:.0%} | {cfg.label} | {_gib(ok[0]['limit'])} | {mean:.2f} ± {sd:.2f} | "
                         f"{ratio:.2f}x | {mb_tok:.1f} | {flt_tok:.0f} | {_gib(peak)} | "
                         f"{'' if hit is None else f'{hit:.1%}'} | {'yes' if same else 'NO' if same is not None else '?'} |")
            rows.append({"fraction": f, "config": cfg.label, "limit": ok[0]["limit"], "tok_s": tps,
                         "tok_s_mean": mean, "tok_s_sd": sd, "ratio_to_stock": ratio, "mb_read_per_token": mb_tok,
                         "major_faults_per_token": flt_tok, "peak_bytes": peak, "ram_hit_rate": hit,
                         "same_greedy_as_stock": same, "loadavg": [r["loadavg"] for r in ok],
                         "release_advice": ok[0].get("release_advice"), "resident_before": [r["resident_before"] for r in ok]})
    return lines, rows


def _prepared(args, out_base: Path) -> dict:
    """The preparation's output, reused from ``<out>.prep.json`` when made for this model file
    and these texts (it costs a model load and a calibration prefill)."""
    cache = out_base.with_suffix(".prep.json")
    st = args.model.stat()
    key = {"model": str(args.model), "size": st.st_size, "mtime": st.st_mtime, "texts": args.texts,
           "max_tokens": args.max_tokens}
    if cache.exists():
        old = json.loads(cache.read_text())
        if old.get("key") == key:
            return old["prep"]
    r = subprocess.run([sys.executable, __file__, "--prepare", str(out_base)], capture_output=True, text=True,
                       input=json.dumps({"model": str(args.model), "texts": args.texts, "max_tokens": args.max_tokens,
                                         "threads": args.threads}),
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=args.child_timeout)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        raise SystemExit(1)
    prep = json.loads(r.stdout)
    write_text_atomic(cache, json.dumps({"key": key, "prep": prep}))
    return prep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="the MoE GGUF (at least twice the limit)")
    ap.add_argument("--generate", type=Path, default=None, metavar="PATH",
                    help="write the bench model (Qwen3-30B-A3B layer shape, 16 layers, Q4_0 experts, 5.4 GiB) "
                         "here first, if it is not there")
    ap.add_argument("--fractions", default="25,50,75",
                    help="RAM budgets, percent of the expert bytes (25,50,75); 100 runs stock alone, the ceiling")
    ap.add_argument("--policies", default=",".join(POLICIES), help="tier policies at 50 %% (%(default)s)")
    ap.add_argument("--other-policies", default="lru-cpu,saem",
                    help="tier policies at the other fractions (%(default)s)")
    ap.add_argument("--thread-prefetch", action="store_true",
                    help="also saem at 50 %% with --ram-prefetch thread (madvise vs readahead thread)")
    ap.add_argument("--no-route", action="store_true",
                    help="also saem at 50 %% with --no-ram-route-prefetch (what the in-graph read-ahead adds)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--texts", type=int, default=1, help="held-out reasoning texts replayed (1)")
    ap.add_argument("--max-tokens", type=int, default=48, help="decoded tokens per text (48)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--overhead", type=int, default=700 << 20,
                    help="bytes the process needs besides weights and KV (Python, NumPy, Numba, compute buffers)")
    ap.add_argument("--margin", type=int, default=256 << 20, help="bytes of slack in every limit")
    ap.add_argument("--hw", default="rtx3060-ddr4", help="cost model preset for the policies (no measuring)")
    ap.add_argument("--child-timeout", type=float, default=600)
    ap.add_argument("--json", type=output_file, default=None)
    ap.add_argument("--probe-prefetch", action="store_true",
                    help="only time the ways to read a cold expert (page faults, MADV_RANDOM, MADV_WILLNEED, "
                         "MADV_POPULATE_READ) on --model, and exit")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prepare", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        print(json.dumps(child(json.loads(sys.stdin.read()))))
        return 0
    if args.prepare is not None:
        job = json.loads(sys.stdin.read())
        print(json.dumps(prepare(Path(job["model"]), args.prepare, job["texts"], job["max_tokens"], job["threads"])))
        return 0
    if args.probe_prefetch:
        if args.model is None or not args.model.is_file():
            print("error: --probe-prefetch needs --model", file=sys.stderr)
            return 1
        for r in probe_prefetch(args.model):
            print(f"{r['way']:<32} {r['ms_per_expert']:6.1f} ms per expert  {r['mb_read_per_expert']:5.1f} MB read")
        return 0
    why = cgroups_usable()
    if why is not None:
        print(f"skip: bench_ram_tier measures under memory cgroups and {why}", file=sys.stderr)
        return 0
    if args.generate is not None:
        if not args.generate.exists():
            subprocess.run([sys.executable, "-m", "saem_gguf", "gen-model", *GEN_FLAGS, "-o", str(args.generate)],
                           check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
            os.sync()  # clean pages: dropping them from the cache must not wait for writeback
        args.model = args.model or args.generate
    if args.model is None or not args.model.is_file():
        print("error: --model is not a file (or give --generate PATH)", file=sys.stderr)
        return 1
    sys.path.insert(0, str(REPO))
    from saem_gguf.build import BuildConfig, find_build

    stock_lib = find_build(BuildConfig(variant="stock"))
    if stock_lib is None:
        print("error: the stock llama.cpp build is missing: python -m saem_gguf build --variant stock", file=sys.stderr)
        return 1
    fractions = [float(x) / 100 for x in args.fractions.split(",") if x.strip()]
    out_base = args.json or Path(f"/tmp/bench_ram_tier.{os.getpid()}.json")
    prep = _prepared(args, out_base)
    configs: list[Config] = []
    for f in fractions:
        configs.append(Config("stock", f))
        if f >= 1.0:  # the ceiling: every expert fits, nothing to place
            continue
        if f == fractions[0]:
            configs.append(Config("no-mmap", f))
        pols = args.policies if abs(f - 0.5) < 1e-9 else args.other_policies
        configs += [Config("tier", f, p) for p in pols.split(",") if p]
        if args.thread_prefetch and abs(f - 0.5) < 1e-9:
            configs.append(Config("tier", f, "saem", "thread"))
        if args.no_route and abs(f - 0.5) < 1e-9:
            configs.append(Config("tier", f, "saem", route_prefetch=False))
    head = (f"model {args.model.name}: {_gib(prep['model_bytes'])} ({_gib(prep['expert_bytes'])} experts, "
            f"{_gib(prep['non_expert_bytes'])} other); {sum(len(t['text']) for t in prep['texts'])} decoded tokens "
            f"per run after a {sum(len(t['prompt']) for t in prep['texts'])}-token prompt; calibration "
            f"{prep['calib_tokens']} tokens of other texts; {args.reps} reps; threads {args.threads}")
    print(head, file=sys.stderr)
    results: dict[tuple[str, float], list[dict]] = {}
    for rep in range(args.reps):
        for cfg in configs:
            res = run_config(cfg, prep, args, stock_lib)
            results.setdefault((cfg.label, cfg.fraction), []).append(res)
            brief = (f"{res['tok_s']:.2f} tok/s, {res['read_bytes'] / 1e6:.0f} MB read, "
                     f"{res['major_faults']} major faults, peak {_gib(res['peak'])} of {_gib(res['limit'])}, "
                     f"load {res['load_s']:.1f} s, loadavg {res['loadavg']:.2f}"
                     if "tok_s" in res else res.get("skipped") or res.get("error"))
            print(f"rep {rep} {cfg.fraction:.0%} {cfg.label}: {brief}", file=sys.stderr)
    lines, rows = summarise(results, configs, fractions)
    print(head)
    print("\n".join(lines))
    if args.json:
        write_text_atomic(args.json, json.dumps({"head": head, "rows": rows, "prep": {k: v for k, v in prep.items() if k != "texts"},
                                         "overhead": args.overhead, "margin": args.margin,
                                         "runs": {f"{k[0]}@{k[1]}": v for k, v in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
