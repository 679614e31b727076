"""Hardware cost model: how long an expert takes on the GPU, on the CPU, or to move over the link.

The simulator and the SAEM planner read the model as a flat float64 array (``CostModel.array``)
so that the Numba hot loops can price every expert of every step without Python calls. The
dataclasses around it hold the human-facing numbers: a model shape (what one expert weighs)
and a hardware profile (bandwidths, latencies, overheads). Presets cover a few common machines;
``hw_measure`` measures this one (``get_hw("measure")``).

All formulas are rooflines (see docs/POLICIES.md): decode-time MoE matmuls are bandwidth-bound
at few tokens, so weight bytes over memory bandwidth dominate and the FLOP term only matters
once many tokens share an expert.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from saem_gguf.errors import SaemError

# --------------------------------------------------------------------------------------------
# Bytes per expert from ggml block sizes


def _qtype(name_or_type) -> "object":
    import gguf

    if isinstance(name_or_type, gguf.GGMLQuantizationType):
        return name_or_type
    if isinstance(name_or_type, int):
        try:
            return gguf.GGMLQuantizationType(name_or_type)
        except ValueError:
            raise SaemError(f"unknown ggml quant type id {name_or_type}") from None
    key = str(name_or_type).upper()
    try:
        return gguf.GGMLQuantizationType[key]
    except KeyError:
        known = ", ".join(t.name for t in gguf.GGMLQuantizationType)
        raise SaemError(f"unknown quant type {name_or_type!r} (known: {known})") from None


def tensor_bytes(n_elements_per_row: int, n_rows: int, qtype) -> int:
    """Bytes of a ggml tensor with rows of ``n_elements_per_row`` elements in ``qtype``.

    ggml quantizes along rows in blocks; a row length that is not a block multiple cannot be
    stored in that type, so it is an error rather than a rounded guess.
    """
    import gguf

    qt = _qtype(qtype)
    block, size = gguf.GGML_QUANT_SIZES[qt]
    if n_elements_per_row % block:
        raise SaemError(f"row length {n_elements_per_row} is not a multiple of the {qt.name} block size {block}")
    return (n_elements_per_row // block) * size * int(n_rows)


def expert_bytes(n_embd: int, n_ff_exp: int, qtype_gate_up="Q4_K", qtype_down=None) -> int:
    """Bytes of one expert (gate + up + down) in one layer.

    gate/up are [n_ff_exp rows x n_embd] and down is [n_embd rows x n_ff_exp] in ggml's layout;
    quantized files often store down in a wider type (Q4_K_M uses Q6_K for some), hence two types.
    """
    qd = qtype_gate_up if qtype_down is None else qtype_down
    return 2 * tensor_bytes(n_embd, n_ff_exp, qtype_gate_up) + tensor_bytes(n_ff_exp, n_embd, qd)


# --------------------------------------------------------------------------------------------
# Model shape


@dataclass
class ModelShape:
    """What the cost model needs to know about a MoE model (per MoE layer unless noted)."""

    name: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_embd: int
    n_ff_exp: int
    q_dim: int  # n_head * head_dim
    kv_dim: int  # n_head_kv * head_dim
    n_vocab: int
    qtype: str = "Q4_K"
    qtype_down: str | None = None
    n_shared_ff: int = 0  # shared-expert FFN width (always on the GPU), 0 when none

    def expert_bytes(self) -> int:
        return expert_bytes(self.n_embd, self.n_ff_exp, self.qtype, self.qtype_down)

    def expert_flops_per_token(self) -> float:
        return 2.0 * 3.0 * self.n_embd * self.n_ff_exp

    def _bpw(self) -> float:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[_qtype(self.qtype)]
        return size / block

    def dense_bytes_per_layer(self) -> float:
        """Attention projections, router and shared expert: read once per step on the GPU."""
        attn = self.n_embd * (2 * self.q_dim + 2 * self.kv_dim)
        router = self.n_embd * self.n_expert * 4.0  # router weights are usually F32
        shared = 3.0 * self.n_embd * self.n_shared_ff
        return (attn + shared) * self._bpw() + router

    def step_bytes(self) -> float:
        """Once per decode step: output head (token embeddings stay on the host in llama.cpp)."""
        return self.n_vocab * self.n_embd * self._bpw()


# Shapes from the models' published configs; quant type is a default, override per file.
MODEL_PRESETS: dict[str, ModelShape] = {
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 128, 8, 2048, 768, 4096, 512, 151936),
    "qwen3-235b-a22b": ModelShape("qwen3-235b-a22b", 94, 128, 8, 4096, 1536, 8192, 512, 151936),
    "ernie-4.5-21b-a3b": ModelShape("ernie-4.5-21b-a3b", 27, 64, 6, 2560, 1536, 2560, 512, 103424,
                                    n_shared_ff=3072),
    "gpt-oss-20b": ModelShape("gpt-oss-20b", 24, 32, 4, 2880, 2880, 4096, 512, 201088, qtype="MXFP4"),
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 32, 8, 2, 4096, 14336, 4096, 1024, 32000),
}


def find_model_shape(n_layer: int, n_expert: int, n_expert_used: int) -> ModelShape | None:
    for shape in MODEL_PRESETS.values():
        if (shape.n_layer, shape.n_expert, shape.n_expert_used) == (n_layer, n_expert, n_expert_used):
            return shape
    return None


# --------------------------------------------------------------------------------------------
# Hardware profile

GB = 1e9


@dataclass
class HardwareProfile:
    """Bandwidths in bytes/s, FLOP rates in FLOP/s, times in seconds."""

    name: str
    gpu_mem_bw: float  # effective VRAM bandwidth for weight reads
    gpu_flops: float  # effective (quantized) matmul throughput
    gpu_launch_s: float  # per expert matmul group (kernel launches, bookkeeping)
    gpu_layer_overhead_s: float  # per layer: norms, attention kernels, router, launches
    h2d_bw: float  # effective host-to-device copy bandwidth (pinned)
    h2d_latency_s: float  # per copy call
    cpu_mem_bw: float  # effective all-core DRAM read bandwidth
    cpu_cores: int
    cpu_flops_per_core: float  # effective quantized dot-product throughput
    cpu_expert_overhead_s: float  # per expert run on the CPU (thread wake-up, quantize activations)
    sync_s: float  # per layer with CPU work: GPU->CPU->GPU split round trip
    cpu_gpu_overlap: bool = False  # run CPU and GPU experts of a layer concurrently
    # The next decode step waits for every copy issued before it (one copy event per step, as
    # the engine's phase-1 native layer does) instead of per-slot readiness.
    copy_barrier: bool = False
    # Host-to-device DMA reads host DRAM: while the link is busy, CPU experts (bandwidth-bound)
    # only get cpu_mem_bw - h2d_bw.
    dma_slows_cpu: bool = True
    # The disk a memory-mapped model pages from (the RAM tier's link, see ram_tier_cost): sustained
    # read bandwidth of expert-sized (MB) reads and the latency of one read request
    ssd_read_bw: float = 2 * GB
    ssd_latency_s: float = 100e-6
    notes: str = ""

    @property
    def cpu_flops(self) -> float:
        return self.cpu_cores * self.cpu_flops_per_core

    def replace(self, **kw) -> "HardwareProfile":
        return dataclasses.replace(self, **kw)

    def with_switches(self, overlap: bool = False, copy_barrier: bool = False) -> "HardwareProfile":
        """This profile with ``--overlap`` / ``--copy-barrier`` turned on where asked (a switch the
        profile already has stays on): the flags of ``simulate`` and ``bench_policies.py``."""
        return self.replace(cpu_gpu_overlap=self.cpu_gpu_overlap or overlap,
                            copy_barrier=self.copy_barrier or copy_barrier)


HW_PRESETS: dict[str, HardwareProfile] = {
    # Consumer desktop: PCIe 4.0 x16 (~25 GB/s pinned), dual-channel DDR5-6000.
    "rtx4090-ddr5": HardwareProfile(
        name="rtx4090-ddr5", gpu_mem_bw=800 * GB, gpu_flops=150e12, gpu_launch_s=4e-6,
        gpu_layer_overhead_s=60e-6, h2d_bw=25 * GB, h2d_latency_s=10e-6, cpu_mem_bw=65 * GB,
        cpu_cores=16, cpu_flops_per_core=60e9, cpu_expert_overhead_s=5e-6, sync_s=30e-6,
        ssd_read_bw=6 * GB, ssd_latency_s=60e-6,
        notes="RTX 4090 24 GB, PCIe 4.0 x16, 16-core desktop CPU, 2ch DDR5-6000, PCIe 4.0 NVMe SSD"),
    # Budget desktop: PCIe 3.0/4.0 mixed reality (~12 GB/s), dual-channel DDR4-3200.
    "rtx3060-ddr4": HardwareProfile(
        name="rtx3060-ddr4", gpu_mem_bw=300 * GB, gpu_flops=40e12, gpu_launch_s=5e-6,
        gpu_layer_overhead_s=80e-6, h2d_bw=12 * GB, h2d_latency_s=12e-6, cpu_mem_bw=38 * GB,
        cpu_cores=8, cpu_flops_per_core=40e9, cpu_expert_overhead_s=6e-6, sync_s=35e-6,
        ssd_read_bw=2.5 * GB, ssd_latency_s=90e-6,
        notes="RTX 3060 12 GB, 8-core CPU, 2ch DDR4-3200, PCIe 3.0 NVMe SSD"),
    # Server: H200 on PCIe 5.0 x16 (~50 GB/s), one socket of 12ch DDR5 (NUMA-local, as SAEM pins).
    "h200-server": HardwareProfile(
        name="h200-server", gpu_mem_bw=4000 * GB, gpu_flops=800e12, gpu_launch_s=3e-6,
        gpu_layer_overhead_s=40e-6, h2d_bw=50 * GB, h2d_latency_s=8e-6, cpu_mem_bw=300 * GB,
        cpu_cores=48, cpu_flops_per_core=80e9, cpu_expert_overhead_s=4e-6, sync_s=20e-6,
        ssd_read_bw=7 * GB, ssd_latency_s=80e-6,
        notes="H200 141 GB, PCIe 5.0 x16, one socket of a 2S server, 12ch DDR5-4800, datacenter NVMe SSD"),
}
DEFAULT_HW = "rtx4090-ddr5"


def get_hw(spec: str) -> HardwareProfile:
    """``PRESET`` | ``measure`` | ``measure:PRESET`` (this machine's CPU side, measured once and
    cached, with the preset's GPU side: hw_measure.py) | ``FILE.json`` (a HardwareProfile as JSON)."""
    from saem_gguf import hw_measure

    if spec in HW_PRESETS:
        return HW_PRESETS[spec]
    if spec == "measure" or spec.startswith("measure:"):
        base = spec.split(":", 1)[1] if ":" in spec else DEFAULT_HW
        return hw_measure.measured_profile(base)[0]
    if spec.endswith(".json"):
        return hw_measure.load_profile(spec)
    raise SaemError(f"unknown hardware {spec!r}: use one of {', '.join(HW_PRESETS)}, measure[:PRESET] "
                    "or FILE.json")


# --------------------------------------------------------------------------------------------
# The flat array the kernels read

C_EXPERT_BYTES = 0
C_EXPERT_FLOPS = 1  # per token
C_GPU_BW = 2
C_GPU_FLOPS = 3
C_GPU_LAUNCH = 4
C_DENSE_LAYER_S = 5  # dense part of one layer (bytes/bw + fixed overhead)
C_STEP_S = 6  # per step outside the layers (output head)
C_CPU_BW = 7
C_CPU_FLOPS = 8
C_CPU_OVERHEAD = 9
C_H2D_BW = 10
C_H2D_LAT = 11
C_SYNC = 12
C_OVERLAP = 13
C_BARRIER = 14
C_DMA_SLOW = 15  # factor on CPU expert time while the link is busy (1 = no contention)
N_COST = 16


@dataclass
class CostModel:
    """A model shape priced on a hardware profile."""

    hw: HardwareProfile
    expert_bytes: int
    expert_flops: float  # per token
    dense_bytes_per_layer: float
    step_bytes: float
    model: str = ""
    array: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.expert_bytes <= 0:
            raise SaemError("expert_bytes must be > 0")
        hw = self.hw
        for k in ("gpu_mem_bw", "gpu_flops", "h2d_bw", "cpu_mem_bw", "cpu_flops_per_core", "ssd_read_bw"):
            if getattr(hw, k) <= 0:
                raise SaemError(f"hardware {hw.name}: {k} must be > 0")
        a = np.zeros(N_COST, np.float64)
        a[C_EXPERT_BYTES] = self.expert_bytes
        a[C_EXPERT_FLOPS] = self.expert_flops
        a[C_GPU_BW] = hw.gpu_mem_bw
        a[C_GPU_FLOPS] = hw.gpu_flops
        a[C_GPU_LAUNCH] = hw.gpu_launch_s
        a[C_DENSE_LAYER_S] = self.dense_bytes_per_layer / hw.gpu_mem_bw + hw.gpu_layer_overhead_s
        a[C_STEP_S] = self.step_bytes / hw.gpu_mem_bw
        a[C_CPU_BW] = hw.cpu_mem_bw
        a[C_CPU_FLOPS] = hw.cpu_flops
        a[C_CPU_OVERHEAD] = hw.cpu_expert_overhead_s
        a[C_H2D_BW] = hw.h2d_bw
        a[C_H2D_LAT] = hw.h2d_latency_s
        a[C_SYNC] = hw.sync_s
        a[C_OVERLAP] = 1.0 if hw.cpu_gpu_overlap else 0.0
        a[C_BARRIER] = 1.0 if hw.copy_barrier else 0.0
        a[C_DMA_SLOW] = hw.cpu_mem_bw / max(hw.cpu_mem_bw - hw.h2d_bw, 0.1 * hw.cpu_mem_bw) if hw.dma_slows_cpu else 1.0
        self.array = a

    @classmethod
    def from_shape(cls, shape: ModelShape, hw: HardwareProfile) -> "CostModel":
        return cls(hw=hw, expert_bytes=shape.expert_bytes(), expert_flops=shape.expert_flops_per_token(),
                   dense_bytes_per_layer=shape.dense_bytes_per_layer(), step_bytes=shape.step_bytes(),
                   model=shape.name)

    @classmethod
    def from_expert_bytes(cls, n_bytes: int, hw: HardwareProfile, bits_per_weight: float = 4.5) -> "CostModel":
        """When only an expert's size is known (e.g. a trace signature): FLOPs from the implied
        parameter count, dense part guessed at two experts' worth of bytes per layer."""
        params = n_bytes * 8.0 / bits_per_weight
        return cls(hw=hw, expert_bytes=int(n_bytes), expert_flops=2.0 * params,
                   dense_bytes_per_layer=2.0 * n_bytes, step_bytes=0.0, model=f"{n_bytes} B/expert")

    def ram_tier(self) -> "CostModel":
        """This model as the RAM tier's policy must price it: the tier's resident experts run from
        RAM and its link is the disk. Mapped onto the two-tier kernels: the "GPU" is the CPU reading
        RAM (a hit), a "copy" is a read of the expert from disk (``ssd_read_bw``, one
        ``ssd_latency_s``), and a miss is computed while its bytes come from disk (the in-graph
        read-ahead reads exactly the expert, so a miss costs one disk read plus the RAM-speed run's
        overheads). A read-ahead and a miss's read share the disk, so ``dma_slows_cpu`` holds with
        both bandwidths the disk's (C_DMA_SLOW = 10: a miss during a read-ahead waits for it). No
        GPU round trip (``sync_s`` 0); the CPU's per-layer overheads are not in the profile."""
        hw = self.hw
        disk = hw.replace(
            name=f"{hw.name}:ram-tier", gpu_mem_bw=hw.cpu_mem_bw, gpu_flops=hw.cpu_flops,
            gpu_launch_s=hw.cpu_expert_overhead_s, gpu_layer_overhead_s=0.0, h2d_bw=hw.ssd_read_bw,
            h2d_latency_s=hw.ssd_latency_s, cpu_mem_bw=hw.ssd_read_bw,
            cpu_expert_overhead_s=hw.cpu_expert_overhead_s + hw.ssd_latency_s, sync_s=0.0,
            cpu_gpu_overlap=False, copy_barrier=False, dma_slows_cpu=True,
            notes=f"RAM tier of {hw.name}: RAM as the fast tier, the disk as the link")
        return CostModel(hw=disk, expert_bytes=self.expert_bytes, expert_flops=self.expert_flops,
                         dense_bytes_per_layer=self.dense_bytes_per_layer, step_bytes=self.step_bytes,
                         model=self.model)

    # Python mirrors of the kernels, for reports and tests.
    def gpu_time(self, n_tokens: int) -> float:
        return float(t_gpu(n_tokens, self.array))

    def cpu_time(self, n_tokens: int) -> float:
        return float(t_cpu(n_tokens, self.array))

    def transfer_time(self) -> float:
        return float(t_xfer(self.array))

    def crossover_tokens(self, max_tokens: int = 4096) -> int:
        """Smallest token count at which moving an expert beats running it on the CPU
        (0 when the CPU always wins up to ``max_tokens``)."""
        for n in range(1, max_tokens + 1):
            if self.cpu_time(n) > self.transfer_time() + self.gpu_time(n):
                return n
        return 0

    def describe(self) -> dict:
        return {
            "hw": dataclasses.asdict(self.hw),
            "model": self.model,
            "expert_bytes": self.expert_bytes,
            "gpu_expert_us_1tok": self.gpu_time(1) * 1e6,
            "cpu_expert_us_1tok": self.cpu_time(1) * 1e6,
            "transfer_us": self.transfer_time() * 1e6,
            "crossover_tokens": self.crossover_tokens(),
        }


@njit(cache=True)
def t_gpu(n, cost):
    """GPU time of one expert for n tokens: roofline of weight reads vs FLOPs, plus launch."""
    return cost[C_GPU_LAUNCH] + max(cost[C_EXPERT_BYTES] / cost[C_GPU_BW], n * cost[C_EXPERT_FLOPS] / cost[C_GPU_FLOPS])


@njit(cache=True)
def t_cpu(n, cost):
    """CPU time of one expert for n tokens, all cores on it (llama.cpp splits rows over threads)."""
    return cost[C_CPU_OVERHEAD] + max(cost[C_EXPERT_BYTES] / cost[C_CPU_BW], n * cost[C_EXPERT_FLOPS] / cost[C_CPU_FLOPS])


@njit(cache=True)
def t_xfer(cost):
    """Host-to-device copy of one expert (gate+up+down)."""
    return cost[C_H2D_LAT] + cost[C_EXPERT_BYTES] / cost[C_H2D_BW]


@njit(cache=True)
def cpu_phase(work, start, link, cost):
    """Wall time of ``work`` seconds of CPU expert runs starting at ``start`` while the link is
    busy until ``link``: DMA shares the host DRAM bandwidth, so that part runs slower."""
    f = cost[C_DMA_SLOW]
    busy = link - start
    if busy <= 0.0 or f <= 1.0:
        return work
    if work * f <= busy:
        return work * f
    return busy + (work - busy / f)


@njit(cache=True)
def layer_end(t, gpu_t, cpu_t, n_cpu, cost, link):
    """When a layer whose experts could start at ``t`` ends: its GPU work ends at ``gpu_t``, its
    ``n_cpu`` CPU runs take ``cpu_t`` seconds (slowed while the link is busy until ``link``),
    after the GPU part or alongside it (C_OVERLAP), plus one sync when any ran on the CPU."""
    if n_cpu == 0:
        return gpu_t
    if cost[C_OVERLAP] > 0:
        return max(gpu_t, t + cpu_phase(cpu_t, t, link, cost)) + cost[C_SYNC]
    return gpu_t + cpu_phase(cpu_t, gpu_t, link, cost) + cost[C_SYNC]


def link_bytes_per_copy(cost: np.ndarray) -> float:
    """What one expert copy takes of a link budget in bytes (Policy.observe's ``link_budget``):
    the bytes the link could move in the copy's whole time, its latency included."""
    return float(t_xfer(cost) * cost[C_H2D_BW])
