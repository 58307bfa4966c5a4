"""One predicted step, whichever model produced it: the analytic one
(`shardkit.analysis.predicted.step_model.step_time`, which ranks layouts before any compile) or the replay of XLA's
compiled schedule (`replayed_step_time`, which decides among the compiled ones). `suggest`, `plan --target` and
`hlo --target` print a compiled layout's step with `format_predicted`, so the three show the same figure for the same
layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardkit.analysis.predicted.comm_terms import CommItem
from shardkit.analysis.predicted.flops import flops_per_step
from shardkit.analysis.predicted.overlap import ExposureReport

INTRA, INTER = "intra-host", "inter-host"


@dataclasses.dataclass(frozen=True)
class CommTime:
    """One stream of collectives priced on the target: seconds on the wire and seconds not hidden by compute."""

    item: CommItem
    link: str
    seconds: float
    exposed: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The predicted step: per-device compute, pipeline bubble and exposed communication, in seconds; `source` says
    which model ("analytic" or "replay of the compiled schedule")."""

    compute: float
    bubble: float
    comm: tuple[CommTime, ...]
    model_flops: float  # per step, all devices, without recompute (the MFU convention)
    devices: int
    peak_flops: float
    source: str = "analytic"

    @property
    def exposed(self) -> float:
        return sum(c.exposed for c in self.comm)

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.exposed

    @property
    def mfu(self) -> float:
        return self.model_flops / self.total / (self.devices * self.peak_flops)

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.total, "compute": self.compute, "bubble": self.bubble, "exposed_comm": self.exposed,
                "mfu": self.mfu, "source": self.source,
                "comm": [{"what": c.item.what, "kind": c.item.kind, "axes": list(c.item.axes), "bytes": c.item.bytes,
                          "link": c.link, "seconds": c.seconds, "exposed": c.exposed} for c in self.comm]}


REPLAY = "replay of the compiled schedule"


def replayed_step_time(report: ExposureReport, layout, target) -> StepTime:
    """The step of a compiled layout as the replay found it: its kernels (a pipeline's bubble ticks among them) and
    the waits at its collectives' dones, per mesh axes and kind."""
    comm = []
    for axes, kinds in report.by_axes_and_kind().items():
        for kind, entry in kinds.items():
            names = () if axes in ("none", "unknown") else tuple(axes.split("+"))
            item = CommItem(f"compiled {kind} over {axes}", kind, names, entry["bytes"], 0)
            comm.append(CommTime(item, INTER if entry["network"] else INTRA, entry["comm_s"], entry["exposed_s"]))
    return StepTime(report.compute_seconds, 0.0, tuple(comm), flops_per_step(layout), layout.mesh.size,
                    target.spec.peak_bf16_flops, REPLAY)


def format_predicted(step: StepTime, target) -> str:
    """`predicted step on h100x8: 1.2345 s (...), MFU 50.1%`: the one line all three commands print."""
    return (f"predicted step on {target}: {step.total:.4f} s (compute {step.compute:.4f}, bubble {step.bubble:.4f}, "
            f"exposed communication {step.exposed:.4f}; {step.source}), MFU {step.mfu:.1%}")
