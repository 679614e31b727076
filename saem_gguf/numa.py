"""NUMA topology and pinning of the CPU expert threads (llama.cpp's --numa, plus GPU locality).

SAEM runs non-resident experts in place on the CPU; those threads should read weights from their
own node. We find the nodes (sysfs), the node nearest the GPU (its PCI device's numa_node), and
pin the process (ggml's worker threads inherit the affinity) to that node's CPUs. On a
single-node machine everything here is a no-op that `describe()` reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from saem_gguf.errors import SaemError

NUMA_MODES = ("off", "distribute", "isolate", "numactl")
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
    mode: str
    node: int | None  # node the expert threads are pinned to (None: not pinned)
    cpus: list[int]
    llama_strategy: int  # ggml_numa_strategy for llama_numa_init (0 = disabled)
    note: str


# ggml_numa_strategy values (ggml-cpu.h)
GGML_NUMA_STRATEGY = {"off": 0, "distribute": 1, "isolate": 2, "numactl": 3}


def plan(mode: str, topo: Topology | None = None) -> NumaPlan:
    if mode not in NUMA_MODES:
        raise SaemError(f"--numa must be one of {', '.join(NUMA_MODES)}, got {mode!r}")
    topo = topo or detect()
    if topo.n_nodes <= 1:
        cpus = sorted(os.sched_getaffinity(0))
        return NumaPlan(mode, None, cpus, 0,
                        f"single NUMA node ({len(cpus)} CPUs): no pinning needed")
    if mode == "off":
        return NumaPlan(mode, None, sorted(os.sched_getaffinity(0)), 0,
                        f"{topo.n_nodes} NUMA nodes, pinning off (--numa off)")
    if mode == "numactl":
        cpus = sorted(os.sched_getaffinity(0))
        return NumaPlan(mode, None, cpus, GGML_NUMA_STRATEGY[mode],
                        "using the CPU set given by numactl")
    if mode == "distribute":
        cpus = sorted(c for cs in topo.nodes.values() for c in cs)
        return NumaPlan(mode, None, cpus, GGML_NUMA_STRATEGY[mode],
                        f"threads spread over {topo.n_nodes} nodes")
    node = topo.preferred_node()
    why = "GPU-local" if topo.gpu_nodes and node in topo.gpu_nodes else "default"
    return NumaPlan(mode, node, topo.nodes[node], GGML_NUMA_STRATEGY[mode],
                    f"expert threads pinned to {why} node {node} ({len(topo.nodes[node])} CPUs)")


def apply(p: NumaPlan) -> None:
    """Pin this process (so ggml's threads) to the plan's CPUs when it names a node."""
    if p.node is not None and p.cpus:
        os.sched_setaffinity(0, p.cpus)
