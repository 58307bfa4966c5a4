"""Published training runs, and what shardkit's analytic step time predicts for each: the README's "predicted against
published" table (`python -m shardkit.analysis.published` prints it) and the test that holds it.

Each run names its source; its layout is what the source says it ran, written as recipe overrides. Published figures
come in three units: model TFLOP/s per GPU (converted with the source's own FLOP count: MaxText's counts the causal
half of attention), tokens/s per GPU, or seconds per step. Where the published cluster differs from DGX H100 (another
network, other H100s), it is described as its own target (`shardkit.analysis.targets.GPUS`, with its sources) and
predicted on that; `cluster` says how it differs. The one row `kernels.OVERHEAD` is calibrated on is marked
`calibration` and shown as such: it is not a prediction.
"""

from __future__ import annotations

import dataclasses

from shardkit.analysis.suggest import base_layout, candidate_layout, load_base, step_time
from shardkit.analysis.targets import parse_target

BF16 = ("precision.policy=bf16",)
# Model shapes from the models' published configurations (Hugging Face config.json of each).
LLAMA2_7B = ("model.preset=8b", "model.layers=32", "model.embed=4096", "model.heads=32", "model.kv_heads=32",
             "model.head_dim=128", "model.mlp=11008", "model.vocab=32000")
LLAMA2_70B = ("model.preset=8b", "model.layers=80", "model.embed=8192", "model.heads=64", "model.kv_heads=8",
              "model.head_dim=128", "model.mlp=28672", "model.vocab=32000")
LLAMA3_8B = ("model.preset=8b",)
A3 = "A3 High VMs, the h100-a3 target: 4 x 200 Gb/s GPU NICs per 8 H100s, a quarter of DGX H100's"
MAXTEXT_A3 = "AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/README.md ({}vm.sh: dcn_data={} ici_fsdp=8, " \
             "per_device_batch 4, seq 4096, remat minimal_flash, cudnn_flash_te)"


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """A published run: model, cluster, layout (recipe overrides), the figure and its unit, and its source."""

    name: str
    target: str
    overrides: tuple[str, ...]
    figure: float
    unit: str  # "tflops/gpu" (MaxText's causal count), "tokens/s/gpu", "s/step" or "mfu"
    source: str
    cluster: str = ""  # how the published cluster differs from DGX H100, when it does, and the target describing it
    calibration: bool = False  # the row `kernels.OVERHEAD` is calibrated on: not a prediction

    def predicted(self) -> float:
        """shardkit's analytic prediction in the run's unit."""
        target = parse_target(self.target)
        recipe = load_base("recipes/fsdp.toml", self.overrides)
        layout = candidate_layout(base_layout(recipe), recipe, target)
        time = step_time(layout, target)
        train, config = recipe.train, layout.config
        tokens_per_gpu = train.global_batch * train.seq_len / time.total / target.devices
        if self.unit == "tokens/s/gpu":
            return tokens_per_gpu
        if self.unit == "s/step":
            return time.total
        if self.unit == "mfu":
            return time.mfu
        attention = 12.0 * config.layers * config.heads * config.head_dim * train.seq_len  # the full square
        causal = time.model_flops / (train.global_batch * train.seq_len) - attention / 2
        return tokens_per_gpu * causal / 1e12

    def ratio(self) -> float:
        """Predicted over published, as throughput (a step time's ratio is inverted so > 1 always means faster)."""
        predicted = self.predicted()
        return self.figure / predicted if self.unit == "s/step" else predicted / self.figure


RUNS = (
    PublishedRun("MaxText Llama2-7B", "h100x8",
                 (*LLAMA2_7B, *BF16, "mesh.fsdp=8", "train.global_batch=32", "train.seq_len=4096",
                  "train.remat=minimal_with_context"),
                 492, "tflops/gpu", MAXTEXT_A3.format(1, 1), calibration=True),
    PublishedRun("MaxText Llama2-7B", "h100-a3:2x8",
                 (*LLAMA2_7B, *BF16, "mesh.data=2", "mesh.fsdp=8", "train.global_batch=64", "train.seq_len=4096",
                  "train.remat=minimal_with_context"),
                 422, "tflops/gpu", MAXTEXT_A3.format(2, 2), A3),
    PublishedRun("MaxText Llama2-7B", "h100-a3:16x8",
                 (*LLAMA2_7B, *BF16, "mesh.data=16", "mesh.fsdp=8", "train.global_batch=512", "train.seq_len=4096",
                  "train.remat=minimal_with_context"),
                 375, "tflops/gpu", MAXTEXT_A3.format(16, 16), A3),
    PublishedRun("MaxText Llama2-70B", "h100:8x8",
                 (*LLAMA2_70B, *BF16, "mesh.fsdp=64", "train.global_batch=128", "train.seq_len=4096",
                  "train.remat=full"),
                 7.908, "s/step",
                 "NGC catalog, 'Maxtext Llama2 70B 25.01.1 (DGXC Benchmarking)': 64 x H100, FSDP 64, GBS 128, BF16, "
                 "'completed step: 49, seconds: 7.908, TFLOP/s/device: 460.480' (remat not stated: full assumed)"),
    PublishedRun("torchtitan Llama3.1-8B", "h100-gtx8",
                 (*LLAMA3_8B, *BF16, "mesh.fsdp=8", "train.global_batch=16", "train.seq_len=8192",
                  "train.remat=selective"),
                 6667, "tokens/s/gpu",
                 "pytorch/torchtitan docs/performance.md, Table 1: FSDP + torch.compile, local batch 2, global 16, "
                 "selective activation checkpointing (seq 8192: torchtitan's llama3_8b.toml)",
                 "Grand Teton H100s, the h100-gt target: 96 GB HBM2e at 2.4 TB/s, a 500 W power limit"),
    PublishedRun("NeMo Llama3.1-8B", "h100x8",
                 (*LLAMA3_8B, *BF16, "mesh.data=8", "train.global_batch=128", "train.seq_len=8192",
                  "train.grad_accum=16", "train.remat=none"),
                 0.594, "mfu",
                 "NVIDIA NeMo performance summary, DGX-H100 BF16: 59.4% MFU (layout as the same page's LLAMA3-8B "
                 "rows: 8 GPUs, GBS 128, seq 8192, TP 1, PP 1, data parallel)"),
)


def table() -> str:
    """The README table: model, cluster, layout, published figure and source, prediction, ratio."""
    lines = ["| model | cluster (target) | layout | published | shardkit predicts | predicted / published | "
             "calibration? | source |", "|---|---|---|---|---|---|---|---|"]
    for run in RUNS:
        layout = ", ".join(o.split("=", 1)[0].split(".")[1] + "=" + o.split("=", 1)[1]
                           for o in run.overrides if o.startswith(("mesh.", "train.remat")))
        fmt = (lambda v: f"{v:.1%}") if run.unit == "mfu" else (lambda v: f"{v:,.3g}")
        note = f" ({run.cluster})" if run.cluster else ""
        role = "yes: `kernels.OVERHEAD` is fitted on it" if run.calibration else "no: predicted"
        lines.append(f"| {run.name} | {run.target} | {layout} | {fmt(run.figure)} {run.unit} | "
                     f"{fmt(run.predicted())} | {run.ratio():.2f} | {role} | {run.source}{note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
