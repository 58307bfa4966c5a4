"""Collective times as NCCL runs them: rings inside a node over NVLink, rings or trees across nodes sharing the nodes'
NICs, a latency per ring step.

NCCL prices a collective as latency + bytes / algorithm bandwidth (`ncclTopoGetAlgoTime` in NCCL's
src/graph/tuning.cc) and picks the fastest algorithm; this module does the same with its constants:
- Latency (Simple protocol, the one large messages use): a base of 8.4 us per collective plus, per ring step, 3.4 us
  over NVLink or 6.6 us over the network; a ring all-gather or reduce-scatter of n ranks on h nodes takes n - 1
  steps of which h - 1 cross the network, an all-reduce twice as many (NCCL tuning.cc: `baseLat` Ring/Simple,
  `hwLat` NVLINK and NET Ring/Simple, and its `nsteps` / `nInterSteps`).
- Inside a node: each GPU sends the ring's (n-1)/n (twice for all-reduce) of the buffer over NVLink at the link's
  bandwidth x link efficiency (NVIDIA's nccl-tests on DGX H100 reach about 80% of NVLink 4's 450 GB/s one way).
- Across h nodes with g GPUs of the group on each: what a node must receive is (h-1)/h of the gathered buffer
  (twice for all-reduce), spread over the g NICs its GPUs of the group own (one 400 Gb/s ConnectX-7 per GPU on DGX
  H100); the NVLink part of the ring runs at the same time, so the slower of the two sets the bandwidth term.
- All-reduce across more than two nodes may use NCCL's tree instead: latency grows with log2(nodes), bandwidth is
  capped at 80 GB/s bus bandwidth (tuning.cc's `maxTreeBw` for nNodes > 2); the faster is taken.
"""

from __future__ import annotations

import dataclasses
import math

BASE_LATENCY = 8.4e-6  # s per collective, Ring/Simple
NVLINK_STEP_LATENCY = 3.4e-6  # s per ring step within a node
NETWORK_STEP_LATENCY = 6.6e-6  # s per ring step between nodes
TREE_MAX_BUS_BANDWIDTH = 80e9  # bytes/s, NCCL's cap for trees over more than two nodes


@dataclasses.dataclass(frozen=True)
class Fabric:
    """One GPU's links: NVLink inside its node, its NIC between nodes (bytes/s one way, efficiency applied)."""

    nvlink: float
    nic: float


@dataclasses.dataclass(frozen=True)
class Group:
    """The ranks of one collective: how many nodes it spans and how many of its ranks sit on each node."""

    nodes: int
    per_node: int

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


def ring_factor(kind: str, n: int) -> float:
    """Share of the full buffer one rank sends in a ring: (n-1)/n, twice for all-reduce; a permute sends it all."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind in ("collective-permute", "send", "recv"):
        return 1.0
    return (n - 1) / n


def ring_steps(kind: str, group: Group) -> tuple[int, int]:
    """(steps within a node, steps between nodes) of a ring collective, as NCCL counts them."""
    passes = 2 if kind == "all-reduce" else 1
    steps = passes * (group.ranks - 1)
    inter = passes * (group.nodes - 1)
    return steps - inter, inter


def collective_seconds(kind: str, buffer_bytes: float, group: Group, fabric: Fabric) -> float:
    """Time of one collective over `group`: its full buffer (what it gathers or reduces) moved by NCCL's ring, or
    its tree for all-reduce across more than two nodes, whichever is faster.

    A collective-permute (pipeline sends) is one hop of the buffer over NVLink or, between nodes, the NIC.
    """
    if group.ranks <= 1 or buffer_bytes <= 0:
        return 0.0
    if kind == "collective-permute":
        link = fabric.nic if group.nodes > 1 else fabric.nvlink
        return BASE_LATENCY + buffer_bytes / link
    time = _ring_seconds(kind, buffer_bytes, group, fabric)
    if kind == "all-reduce" and group.nodes > 2:
        time = min(time, _tree_seconds(buffer_bytes, group, fabric))
    return time


def _ring_seconds(kind: str, buffer_bytes: float, group: Group, fabric: Fabric) -> float:
    intra_steps, inter_steps = ring_steps(kind, group)
    latency = BASE_LATENCY + intra_steps * NVLINK_STEP_LATENCY + inter_steps * NETWORK_STEP_LATENCY
    nvlink = buffer_bytes * ring_factor(kind, group.ranks) / fabric.nvlink if group.per_node > 1 else 0.0
    network = 0.0
    if group.nodes > 1:
        # What one node receives, over the NICs of its ranks in the group.
        network = buffer_bytes * ring_factor(kind, group.nodes) / (group.per_node * fabric.nic)
    return latency + max(nvlink, network)


def _tree_seconds(buffer_bytes: float, group: Group, fabric: Fabric) -> float:
    """NCCL's tree all-reduce: a reduce up and a broadcast down, bus bandwidth capped (tuning.cc's maxTreeBw)."""
    latency = BASE_LATENCY + 2 * ((group.per_node - 1) * NVLINK_STEP_LATENCY
                                  + math.log2(group.nodes) * NETWORK_STEP_LATENCY)
    bus = min(group.per_node * fabric.nic, TREE_MAX_BUS_BANDWIDTH)
    return latency + 2 * buffer_bytes / bus


def axes_group(axes, per_host, across) -> Group:
    """The group of a collective over mesh `axes`, given each axis's size within a host and across hosts
    (`shardkit.analysis.predicted.targets.Target.host_split`)."""
    return Group(math.prod(across[axis] for axis in axes), math.prod(per_host[axis] for axis in axes))


def stream_seconds(kind: str, buffer_bytes: float, group_size: int, group: Group, fabric: Fabric,
                   messages: int = 1) -> float:
    """`messages` equal collectives of `kind` moving `buffer_bytes` in all, as the analytic model and the schedule
    replay both price them. A collective-permute's bytes are its group's sends (what `shardkit.analysis.compiled.hlo`
    counts): one device sends its share, one hop, over NVLink or, between hosts, the NIC. Kinds without a ring
    formula of their own (all-to-all) move (n-1)/n of the buffer like an all-gather."""
    if kind == "collective-permute":
        buffer_bytes, group = buffer_bytes / max(group_size, 1), Group(2, 1) if group.nodes > 1 else Group(1, 2)
    elif kind not in ("all-reduce", "reduce-scatter", "all-gather"):
        kind = "all-gather"
    count = max(messages, 1)
    return count * collective_seconds(kind, buffer_bytes / count, group, fabric)
