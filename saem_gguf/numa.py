"""NUMA: llama.cpp's ``--numa`` strategies, and our pinning of the CPU expert threads to the GPU's node.

``--numa distribute|isolate|numactl`` means what it means in llama.cpp: the value is handed to
``llama_numa_init`` (ggml's thread placement) and nothing else is done. ``--pin-gpu-node`` is
ours: SAEM runs non-resident experts in place on the CPU, and those threads should read weights
from their own node, so we find the nodes (sysfs), the node nearest the GPU (its PCI device's
numa_node), and pin the process (ggml's worker threads inherit the affinity) to that node's CPUs.
On a single-node machine pinning is a no-op that the plan's note reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from saem_gguf.errors import SaemError

# llama.cpp's --numa values (common/arg.cpp) and their ggml_numa_strategy (ggml-cpu.h)
LLAMA_NUMA_STRATEGIES = {"distribute": 1, "isolate": 2, "numactl": 3}
SYS_NODES = Path("/sys/devices/system/node")
SYS_PCI = Path("/sys/bus/pci/devices")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]"""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            cpus.extend(range(int(a), int(b) + 1))
        else:
            cpus.append(int(part))
    return cpus


@dataclass
class Topology:
    nodes: dict[int, list[int]]  # node id -> its CPUs
    gpu_nodes: list[int] = field(default_factory=list)  # node of each NVIDIA/AMD display device

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    def preferred_node(self) -> int:
        """The GPU-local node when one is known, else node 0 (or the lowest node id)."""
        for n in self.gpu_nodes:
            if n in self.nodes:
                return n
        return 0 if 0 in self.nodes else min(self.nodes)


def detect(sys_nodes: Path = SYS_NODES, sys_pci: Path = SYS_PCI) -> Topology:
    nodes: dict[int, list[int]] = {}
    if sys_nodes.is_dir():
        for d in sorted(sys_nodes.glob("node[0-9]*")):
            try:
                cpus = parse_cpulist((d / "cpulist").read_text())
            except (OSError, ValueError):
                continue
            if cpus:
                nodes[int(d.name[4:])] = cpus
    if not nodes:
        nodes = {0: sorted(os.sched_getaffinity(0))}
    gpu_nodes: list[int] = []
    if sys_pci.is_dir():
        for dev in sorted(sys_pci.iterdir()):
            try:
                vendor = (dev / "vendor").read_text().strip()
                cls = (dev / "class").read_text().strip()
                node = int((dev / "numa_node").read_text().strip())
            except (OSError, ValueError):
                continue
            # display controllers (0x03xxxx) or 3D controllers (0x0302xx) of NVIDIA / AMD
            if vendor in ("0x10de", "0x1002") and cls.startswith("0x03") and node >= 0:
                gpu_nodes.append(node)
    return Topology(nodes, gpu_nodes)


@dataclass
class NumaPlan:
    strategy: str | None  # llama.cpp's --numa value, None when not given
    node: int | None  # node the expert threads are pinned to (None: not pinned)
    cpus: list[int]
    llama_strategy: int  # ggml_numa_strategy for llama_numa_init (0 = disabled)
    note: str


def plan(strategy: str | None = None, pin_gpu_node: bool = False, topo: Topology | None = None) -> NumaPlan:
    """``strategy``: llama.cpp's --numa value (or None); ``pin_gpu_node``: pin to the GPU's node."""
    if strategy is not None and strategy not in LLAMA_NUMA_STRATEGIES:
        raise SaemError(f"--numa must be one of {', '.join(LLAMA_NUMA_STRATEGIES)}, got {strategy!r}")
    ggml = LLAMA_NUMA_STRATEGIES.get(strategy, 0)
    llama_note = f"llama.cpp --numa {strategy}" if strategy else "llama.cpp NUMA strategy off"
    cpus = sorted(os.sched_getaffinity(0))
    if not pin_gpu_node:
        return NumaPlan(strategy, None, cpus, ggml, f"{llama_note}, no pinning")
    topo = topo or detect()
    if topo.n_nodes <= 1:
        return NumaPlan(strategy, None, cpus, ggml,
                        f"{llama_note}; single NUMA node ({len(cpus)} CPUs): no pinning needed")
    node = topo.preferred_node()
    why = "GPU-local" if topo.gpu_nodes and node in topo.gpu_nodes else "default (no GPU node known)"
    return NumaPlan(strategy, node, topo.nodes[node], ggml,
                    f"{llama_note}; expert threads pinned to {why} node {node} "
                    f"({len(topo.nodes[node])} CPUs)")


def apply(p: NumaPlan) -> None:
    """Pin this process (so ggml's threads) to the plan's CPUs when it names a node."""
    if p.node is not None and p.cpus:
        os.sched_setaffinity(0, p.cpus)
