"""``--hw measure``: this machine's hardware profile, measured once and cached per machine.

The cost model prices an expert run on the CPU (bandwidth-bound at a few tokens: weight bytes over
DRAM read bandwidth, plus a FLOP term) against copying it over the host-to-device link. The CPU
side and the disk are measured here with short real runs (under a second together):

- DRAM read bandwidth: all usable CPUs sum disjoint chunks of a 64 MiB array, far larger than the
  last-level cache, which is the read-only stream a quantized expert GEMV makes;
- matmul throughput per core: the best of many short float32 products on one core (BLAS held to
  one thread, in a child process), halved for what quantized ggml dot products reach; a rate no
  real core has is measured again, and if it stays so, used once with a warning but not cached;
- the read bandwidth and latency of the disk under the cache directory (a 64 MiB scratch file,
  written, dropped from the page cache, read back; ``measure_disk_read``), the RAM tier's link.

The GPU and link side (VRAM bandwidth, copy bandwidth and latency, launch overheads) is not
measured: it comes from a preset (``rtx4090-ddr5`` unless ``measure:PRESET`` names another), with
or without a GPU in the machine, and the profile's ``notes`` say so. Without a GPU that is the
documented fallback: the cost model then answers "what if this CPU drove that GPU".

The result is cached as JSON under ``<cache>/hw/<key>.json``; the key hashes the machine's
identity (CPU model, usable CPUs, RAM, the PCI ids of its GPUs) and the preset, so a different
machine or a changed CPU set measures again. The cached file is itself a valid ``--hw FILE.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from saem_gguf.costmodel import GB, HW_PRESETS, HardwareProfile
from saem_gguf.errors import SaemError

SYS_PCI = Path("/sys/bus/pci/devices")
GPU_VENDORS = ("0x10de", "0x1002", "0x8086")  # NVIDIA, AMD, Intel


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_identity(sys_pci: Path = SYS_PCI) -> dict:
    """What the measurement depends on: CPU model, usable CPUs, RAM, the GPUs' PCI ids."""
    import platform

    import psutil

    cpu_model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = []
    if sys_pci.is_dir():
        for dev in sorted(sys_pci.iterdir()):
            try:
                vendor = (dev / "vendor").read_text().strip()
                cls = (dev / "class").read_text().strip()
                device = (dev / "device").read_text().strip()
            except OSError:
                continue
            if vendor in GPU_VENDORS and cls.startswith("0x03"):  # display / 3D controllers
                gpus.append(f"{vendor}:{device}")
    return {"cpu": cpu_model, "cpus": _usable_cpus(), "ram_bytes": psutil.virtual_memory().total,
            "gpus": gpus}


def measure_memory_bandwidth(n_bytes: int = 64 << 20, repeats: int = 3, threads: int | None = None) -> float:
    """All-core read bandwidth in bytes/s: best of a few timed sums over an array much larger than
    the last-level cache, one chunk per thread (numpy's reduction releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    threads = threads or _usable_cpus()
    a = np.ones(n_bytes // 8, dtype=np.float64)
    chunks = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, chunks))  # touch the pages outside the timing
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


# A core's float32 GEMM rate outside this range is a measurement gone wrong (the run preempted
# throughout, a mis-read clock), not a CPU: an old low-power core reaches a few GFLOP/s, an AVX-512
# core with two FMA units at 5 GHz about 320.
PLAUSIBLE_GEMM_FLOPS_PER_CORE = (1e9, 400e9)
# quantized ggml dot products reach roughly half the float32 GEMM rate (dequantisation work)
QUANT_SHARE_OF_GEMM = 0.5

# Run in a child process whose BLAS is held to one thread (the variables are read when the BLAS
# library loads, so they cannot be changed inside this process): the best of ``repeats`` timed
# n x n float32 products, in seconds.
_GEMM_PROBE = """
import sys, time
import numpy as np
n, repeats = int(sys.argv[1]), int(sys.argv[2])
a = np.random.default_rng(0).random((n, n), dtype=np.float32)
a @ a
best = float("inf")
for _ in range(repeats):
    t0 = time.perf_counter()
    a @ a
    best = min(best, time.perf_counter() - t0)
print(repr(best))
"""
_ONE_THREAD = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                                "VECLIB_MAXIMUM_THREADS")}


def single_core_gemm_seconds(n: int, repeats: int) -> float:
    """Best time of ``repeats`` n x n float32 matrix products on one core (numpy's BLAS in a child
    process held to one thread)."""
    import subprocess

    try:
        out = subprocess.run([sys.executable, "-c", _GEMM_PROBE, str(n), str(repeats)],
                             env={**os.environ, **_ONE_THREAD}, capture_output=True, text=True, timeout=60,
                             check=True).stdout
        return float(out)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        raise SaemError(f"could not measure this CPU's matrix product rate: {e}") from None


@dataclass(frozen=True)
class FlopsMeasurement:
    """What ``measure_flops_per_core`` found: ``flops_per_core`` is what quantized ggml dot
    products reach, taken as half the best single-core float32 GEMM rate ``gemm_flops``; that
    rate was ``plausible`` (within PLAUSIBLE_GEMM_FLOPS_PER_CORE) after ``attempts`` tries."""

    flops_per_core: float
    gemm_flops: float
    attempts: int
    plausible: bool


def measure_flops_per_core(n: int = 256, repeats: int = 30, attempts: int = 3,
                           probe=None) -> FlopsMeasurement:
    """FLOP/s per core from short single-threaded matrix products, the best of ``repeats`` (a run
    the scheduler preempted only comes out slower, so the best is the core's speed). All-core
    BLAS divided by the core count collapses when another process holds a core (its threads wait
    for each other): 0.8 against 40.3 GFLOP/s per core on one 2-core machine. A rate outside
    PLAUSIBLE_GEMM_FLOPS_PER_CORE is measured again, up to ``attempts`` times in all, keeping the
    one nearest the range. ``probe(n, repeats)`` returns the best product's seconds (default:
    single_core_gemm_seconds)."""
    probe = probe or single_core_gemm_seconds
    nearest = 0.0
    for attempt in range(1, attempts + 1):
        rate = 2.0 * n**3 / probe(n, repeats)
        if gemm_rate_plausible(rate):
            return FlopsMeasurement(QUANT_SHARE_OF_GEMM * rate, rate, attempt, True)
        if nearest == 0.0 or _log_distance_to_plausible(rate) < _log_distance_to_plausible(nearest):
            nearest = rate
    return FlopsMeasurement(QUANT_SHARE_OF_GEMM * nearest, nearest, attempts, False)


def _log_distance_to_plausible(rate: float) -> float:
    """How many e-folds a GEMM rate lies outside PLAUSIBLE_GEMM_FLOPS_PER_CORE (0 inside)."""
    lo, hi = PLAUSIBLE_GEMM_FLOPS_PER_CORE
    return float(np.log(lo / rate)) if rate < lo else max(0.0, float(np.log(rate / hi)))


def gemm_rate_plausible(rate: float) -> bool:
    """Whether a single-core float32 GEMM rate (FLOP/s) can be a real core's."""
    return _log_distance_to_plausible(rate) == 0.0


def measure_cpu(base: HardwareProfile, quick: bool = False) -> HardwareProfile:
    """``base`` with the CPU fields measured on this machine; ``quick`` halves the array."""
    import psutil

    cores = min(psutil.cpu_count(logical=False) or psutil.cpu_count() or 1, _usable_cpus())
    bw = measure_memory_bandwidth(32 << 20 if quick else 64 << 20)
    fl = measure_flops_per_core(repeats=10 if quick else 30)
    mem = psutil.virtual_memory().total
    doubt = "" if fl.plausible else (f" (IMPLAUSIBLE after {fl.attempts} tries: {fl.gemm_flops / 1e9:.2f} GFLOP/s "
                                     "float32 on one core; not cached, measured again next time)")
    return base.replace(
        name=f"measured+{base.name}", cpu_mem_bw=bw, cpu_cores=int(cores), cpu_flops_per_core=fl.flops_per_core,
        notes=f"CPU measured here: {cores} cores, {bw / GB:.1f} GB/s read, "
              f"{fl.flops_per_core / 1e9:.1f} GFLOP/s/core{doubt}, "
              f"{mem / 2**30:.0f} GiB RAM; GPU, host-to-device link and SSD not measured: from the "
              f"{base.name} preset")


def measure_disk_read(directory: Path, n_bytes: int = 64 << 20, read_size: int = 2 << 20,
                      n_latency: int = 32) -> tuple[float, float]:
    """(read bandwidth in bytes/s, latency of one 4 KiB read in s) of the disk under ``directory``:
    a scratch file is written there and synced, its pages dropped from the page cache
    (``posix_fadvise(DONTNEED)``), then read back in expert-sized ``read_size`` requests, then (after
    another drop) ``n_latency`` single pages at spread offsets; the file is removed. What the RAM
    tier's reads meet: a cold expert is one read of a few MB. A tmpfs directory measures RAM."""
    path = directory / f".disk-probe.{os.getpid()}"
    block = np.random.default_rng(0).integers(0, 256, read_size, dtype=np.uint8).tobytes()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for off in range(0, n_bytes, read_size):
                os.pwrite(fd, block, off)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for off in range(0, n_bytes, read_size):
                os.pread(fd, read_size, off)
            bw = n_bytes / (time.perf_counter() - t0)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # one page per read, no readahead
            stride = n_bytes // n_latency
            t0 = time.perf_counter()
            for i in range(n_latency):
                os.pread(fd, 4096, i * stride)
            latency = (time.perf_counter() - t0) / n_latency
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return bw, latency


def cache_path(base_name: str, identity: dict | None = None) -> Path:
    from saem_gguf.build.paths import cache_root

    # format 2: the disk is measured too (a profile cached before has only the preset's disk);
    # 3: FLOP/s per core single-threaded (all-core BLAS over the cores collapsed under load)
    ident = dict(identity or machine_identity(), preset=base_name, format=3)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "hw" / f"{key}.json"


def measured_profile(base_name: str) -> tuple[HardwareProfile, Path, bool]:
    """(profile, its cache file, whether it was measured now) for this machine with ``base_name``'s
    GPU side; measured on the first call, read from the cache afterwards."""
    if base_name not in HW_PRESETS:
        raise SaemError(f"unknown hardware preset {base_name!r} (known: {', '.join(HW_PRESETS)})")
    path = cache_path(base_name)
    if path.exists():
        try:
            return load_profile(path), path, False
        except SaemError:
            pass  # a damaged cache entry is measured again
    hw = measure_cpu(HW_PRESETS[base_name])
    plausible = gemm_rate_plausible(hw.cpu_flops_per_core / QUANT_SHARE_OF_GEMM)
    if not plausible:
        print(f"warning: --hw measure: {hw.cpu_flops_per_core / 1e9:.2f} GFLOP/s per core is not a plausible "
              "CPU's (measured 3 times); using it this once, not cached", file=sys.stderr)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        bw, latency = measure_disk_read(path.parent)
        hw = hw.replace(ssd_read_bw=bw, ssd_latency_s=latency,
                        notes=hw.notes.replace("link and SSD not measured", "link not measured") +
                        f"; disk under the cache measured: {bw / GB:.2f} GB/s in 2 MiB reads, "
                        f"{latency * 1e6:.0f} us per 4 KiB read")
    except OSError:
        pass  # no writable cache: the preset's disk
    if not plausible:
        return hw, path, True
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(hw), indent=1))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        pass  # a read-only cache measures every time; the profile is still right
    return hw, path, True


def load_profile(path: str | os.PathLike) -> HardwareProfile:
    """A HardwareProfile from JSON, every field checked (one-line errors)."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SaemError(f"--hw {where}: no such file") from None
    except OSError as e:
        raise SaemError(f"--hw {where}: cannot read ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise SaemError(f"{where}: not a hardware profile (invalid JSON: {e})") from None
    if not isinstance(data, dict):
        raise SaemError(f"{where}: not a hardware profile (a JSON object of HardwareProfile fields)")
    fields = {f.name: f for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SaemError(f"{where}: not a hardware profile (unknown field {unknown[0]!r})")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise SaemError(f"{where}: not a hardware profile (missing {', '.join(missing)})")
    for name, value in data.items():
        kind = fields[name].type
        if kind in ("bool",) and not isinstance(value, bool):
            raise SaemError(f"{where}: {name} must be true or false, got {value!r}")
        if kind in ("str",) and not isinstance(value, str):
            raise SaemError(f"{where}: {name} must be a string, got {value!r}")
        if kind in ("float", "int"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise SaemError(f"{where}: {name} must be a number, got {value!r}")
            if value < 0 or (value == 0 and name in ("gpu_mem_bw", "gpu_flops", "h2d_bw", "cpu_mem_bw",
                                                     "cpu_cores", "cpu_flops_per_core", "ssd_read_bw")):
                raise SaemError(f"{where}: {name} must be > 0, got {value!r}")
            if kind == "int" and value != int(value):
                raise SaemError(f"{where}: {name} must be a whole number, got {value!r}")
    data = {k: int(v) if fields[k].type == "int" else v for k, v in data.items()}
    return HardwareProfile(**data)
