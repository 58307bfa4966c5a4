"""Published training runs, and what shardkit's analytic step time predicts for each: the docs' "predicted against
published" table (`python -m shardkit.analysis.search.published` prints it) and the test that holds it.

Each run names its source; its layout is what the source says it ran, written as recipe overrides, and a run made
with another framework is priced as that framework runs the layout (`framework`, a `frameworks.Framework`: Megatron-LM's
or Meta's pipelines, sends and attention). Published figures come in five units: model TFLOP/s per GPU (converted
with the source's own FLOP count: MaxText's counts the causal half of attention, Megatron-LM's equation 3 the
recompute too), MFU, tokens/s per GPU, or seconds per step. Where the published cluster differs from DGX H100
(another network, other H100s), it is described as its own target (`shardkit.analysis.predicted.targets.GPUS`, with its
sources) and predicted on that; `cluster` says how it differs. The one row `kernels.OVERHEAD` is calibrated on is
marked `calibration` and shown as such: it is not a prediction. `--breakdown` prints the other frameworks' rows part
by part, as their framework runs them and as shardkit would.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from shardkit.analysis.predicted.flops import active_parameters, training_flops_per_token
from shardkit.analysis.predicted.frameworks import LLAMA3, MEGATRON_SC21, SHARDKIT, Framework
from shardkit.analysis.predicted.step_model import step_time
from shardkit.analysis.predicted.targets import parse_target
from shardkit.analysis.search.planned import base_layout, candidate_layout
from shardkit.analysis.search.suggest import load_base

BF16 = ("precision.policy=bf16",)
# Model shapes from the models' published configurations (Hugging Face config.json of each).
LLAMA2_7B = ("model.preset=8b", "model.layers=32", "model.embed=4096", "model.heads=32", "model.kv_heads=32",
             "model.head_dim=128", "model.mlp=11008", "model.vocab=32000")
LLAMA2_70B = ("model.preset=8b", "model.layers=80", "model.embed=8192", "model.heads=64", "model.kv_heads=8",
              "model.head_dim=128", "model.mlp=28672", "model.vocab=32000")
LLAMA3_8B = ("model.preset=8b",)
# Llama 3 405B (Meta's config.json: 126 layers, embed 16384, 128 heads, 8 KV heads, MLP 53248, vocab 128256), priced
# as Meta lays it out (arXiv 2407.21783v3, section 3.3.2): 16 pipeline ranks of V chunks, "the first model chunk on
# the first stage has only the embedding, and the last model chunk on the last stage has only output projection and
# loss" after "we reduce one Transformer layer each from the first and the last stages". V is not published; both
# quotes hold only if a chunk is one layer (one layer off the first chunk leaves it the embedding alone), so the 126
# layers and the two edge chunks fill 16 V slots: V = 8. The priced model has 128 layers, one per slot, the two edge
# slots standing for the embedding and the head (`LLAMA3.head_in_a_layer_slot`); its MFU counts 126.
LLAMA3_405B_SLOTS = ("model.preset=8b", "model.layers=128", "model.embed=16384", "model.heads=128",
                     "model.kv_heads=8", "model.head_dim=128", "model.mlp=53248", "model.vocab=128256")
TP_SP = 'rules.tensor=["heads", "kv_heads", "mlp", "vocab", "residual_sequence"]'  # recipes/tp_sp.toml's rule
LLAMA3_PAPER = ("The Llama 3 Herd of Models (arXiv 2407.21783v3), Table 4: {gpus} GPUs, TP 8, CP 1, PP 16, DP {dp}, "
                "seq 8,192, batch size/DP {batch}, 16M tokens/batch, {tflops} TFLOPs/GPU, BF16 MFU {mfu}; section "
                "3.3.2: FSDP without re-sharding after the forward, interleaved schedule, asynchronous P2P, no "
                "activation checkpointing at 8K")
MEGATRON_PAPER = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using "
                  "Megatron-LM, Table 1: GPT {params}B, {layers} layers, hidden {hidden}, {heads} heads, TP 8, PP {pp},"
                  " {gpus} GPUs, batch {batch}, {tflops} TFLOP/s per GPU; micro-batch {mbs}, {chunks}, full recompute"
                  " (--recompute-method uniform) from NVIDIA/Megatron-LM examples/sc21/run_table_1.sh")
SELENE = "Selene's DGX A100 80GB nodes, 8 x 200 Gb/s HDR InfiniBand per node: the a100 target"
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
    unit: str  # "tflops/gpu" (MaxText's causal count), "megatron tflops/gpu", "tokens/s/gpu", "s/step" or "mfu"
    source: str
    cluster: str = ""  # how the published cluster differs from DGX H100, when it does, and the target describing it
    calibration: bool = False  # the row `kernels.OVERHEAD` is calibrated on: not a prediction
    framework: Framework = SHARDKIT  # the framework that ran the pipeline (`frameworks.Framework`)
    # Where the priced model has more layers than the published one (Llama 3 405B's 126 layers priced as 128 layer
    # slots), the published count: the MFU's numerator is its model's FLOPs.
    published_layers: int = 0

    def predicted(self) -> float:
        """shardkit's analytic prediction in the run's unit (computed once per run: the test and the table share it)."""
        return _prediction(self)

    def layout(self):
        """The run's layout on its target's planned mesh, and the target."""
        target = parse_target(self.target)
        recipe = load_base("recipes/fsdp.toml", self.overrides)
        return candidate_layout(base_layout(recipe), recipe, target), target

    def _predict(self) -> float:
        layout, target = self.layout()
        recipe = layout.recipe
        time = step_time(layout, target, framework=self.framework)
        train, config = recipe.train, layout.config
        tokens_per_gpu = train.global_batch * train.seq_len / time.total / target.devices
        if self.unit == "tokens/s/gpu":
            return tokens_per_gpu
        if self.unit == "s/step":
            return time.total
        if self.unit == "mfu":
            return self.model_flops(layout) / time.total / (target.devices * time.peak_flops)
        if self.unit == "megatron tflops/gpu":
            return megatron_flops(config, train) / time.total / target.devices / 1e12
        attention = 12.0 * config.layers * config.heads * config.head_dim * train.seq_len  # the full square
        causal = time.model_flops / (train.global_batch * train.seq_len) - attention / 2
        return tokens_per_gpu * causal / 1e12

    def model_flops(self, layout) -> float:
        """The published model's FLOPs per step (`flops.training_flops_per_token`): the priced layout's, less its
        layers beyond `published_layers`."""
        config, train = layout.config, layout.recipe.train
        parameters = active_parameters(layout)
        if self.published_layers:
            stacked = sum(math.prod(leaf.shape) for leaf, logical in zip(
                jax.tree.leaves(layout.abstract_params),
                jax.tree.leaves(layout.logical, is_leaf=lambda x: isinstance(x, tuple))) if logical[:1] == ("layers",))
            parameters -= stacked * (config.layers - self.published_layers) / config.layers
            config = dataclasses.replace(config, layers=self.published_layers)
        return training_flops_per_token(config, parameters, train.seq_len) * train.global_batch * train.seq_len

    def layout_label(self) -> str:
        """`fsdp=64, tensor=8(sp), pipeline=16, interleaved_1f1b m=32 v=8, remat=none (Meta Llama 3)`: the mesh,
        the pipeline schedule, the remat preset and, where it is not shardkit, the framework that ran it."""
        settings = dict(o.split("=", 1) for o in self.overrides)
        parts = [f"{key.split('.')[1]}={value}" + ("(sp)" if key == "mesh.tensor" and TP_SP in self.overrides else "")
                 for key, value in settings.items() if key.startswith("mesh.")]
        if "pipeline.schedule" in settings:
            repeats = settings.get("pipeline.repeats", "1")
            parts.append(f"{settings['pipeline.schedule']} m={settings['pipeline.microbatches']}"
                         + (f" v={repeats}" if repeats != "1" else ""))
        parts.append(f"remat={settings['train.remat']}")
        framework = f" ({self.framework.name})" if self.framework != SHARDKIT else ""
        return ", ".join(parts) + framework

    def ratio(self) -> float:
        """Predicted over published, as throughput (a step time's ratio is inverted so > 1 always means faster)."""
        predicted = self.predicted()
        return self.figure / predicted if self.unit == "s/step" else predicted / self.figure


@functools.cache
def _prediction(run: PublishedRun) -> float:
    return run._predict()


def gpt_as_llama(hidden: int, heads: int, layers: int, tensor: int = 8) -> tuple[str, ...]:
    """A Megatron GPT (vocabulary 51,200, sequence 2,048, multi-head attention) as shardkit's Llama: the GPT's
    non-gated 4h MLP (two h x 4h matrices, 8h^2 parameters, 16h FLOPs a token) becomes a gated MLP of width 8h/3
    (three h x 8h/3 matrices: the same parameters and FLOPs), rounded to a multiple of the tensor degree (h = 16384:
    43,688 for 43,690.7, 0.006% fewer MLP FLOPs; the error is below 0.02% for every row). Not carried over: the GPT's
    biases and learned position embeddings (13h per layer and s x h, under 0.01% of the FLOPs), GELU for SwiGLU."""
    mlp = round(8 * hidden / 3 / tensor) * tensor
    return ("model.preset=8b", f"model.layers={layers}", f"model.embed={hidden}", f"model.heads={heads}",
            f"model.kv_heads={heads}", f"model.head_dim={hidden // heads}", f"model.mlp={mlp}", "model.vocab=51200")


def megatron_run(params: str, hidden: int, heads: int, layers: int, pipeline: int, gpus: int, batch: int,
                 microbatch: int, layers_per_chunk: int | None, tflops: float) -> PublishedRun:
    """A row of Narayanan et al.'s Table 1 (TP 8, full recompute, the interleaved schedule where the SC21 script
    sets layers per virtual stage, plain 1F1B where it sets none), on Selene's A100s as Megatron-LM ran it."""
    data = gpus // (8 * pipeline)
    repeats = layers // pipeline // layers_per_chunk if layers_per_chunk else 1
    chunks = f"{layers_per_chunk} layers a virtual stage" if layers_per_chunk else "no virtual stages"
    schedule = "interleaved_1f1b" if repeats > 1 else "1f1b"
    overrides = (*gpt_as_llama(hidden, heads, layers), *BF16, f"mesh.data={data}", "mesh.tensor=8",
                 f"mesh.pipeline={pipeline}", f"train.global_batch={batch}", "train.seq_len=2048", "train.remat=full",
                 f"pipeline.schedule={schedule}", f"pipeline.microbatches={batch // data // microbatch}",
                 f"pipeline.repeats={repeats}")
    source = MEGATRON_PAPER.format(params=params, layers=layers, hidden=hidden, heads=heads, pp=pipeline, gpus=gpus,
                                   batch=batch, tflops=tflops, mbs=microbatch, chunks=chunks)
    return PublishedRun(f"Megatron-LM GPT {params}B", f"a100:{gpus // 8}x8", overrides, tflops, "megatron tflops/gpu",
                        source, SELENE, framework=MEGATRON_SC21)


def llama3_run(gpus: int, data: int, batch_per_dp: int, tflops: int, mfu: float) -> PublishedRun:
    """A row of the Llama 3 paper's Table 4 at 8K context: FSDP over DP gathering each stage once a step (no
    re-shard after the forward), TP 8 with sequence parallelism, PP 16 interleaved (V = 8), a micro-batch of one
    sequence (batch size/DP micro-batches; the micro-batch size is not published), bf16, no remat."""
    overrides = (*LLAMA3_405B_SLOTS, *BF16, f"mesh.fsdp={data}", "pipeline.fsdp_gather=per_step", TP_SP,
                 "mesh.tensor=8", "mesh.pipeline=16", f"train.global_batch={data * batch_per_dp}",
                 "train.seq_len=8192", "train.remat=none", "pipeline.schedule=interleaved_1f1b",
                 f"pipeline.microbatches={batch_per_dp}", "pipeline.repeats=8")
    source = LLAMA3_PAPER.format(gpus=f"{gpus:,}", dp=data, batch=batch_per_dp, tflops=tflops, mfu=f"{mfu:.0%}")
    return PublishedRun("Meta Llama 3 405B", f"h100:{gpus // 8}x8", overrides, mfu, "mfu", source,
                        "Meta's H100 SXM at 700 W, 80 GB, 400 Gb/s RoCE per GPU: the h100 target", framework=LLAMA3,
                        published_layers=126)


def megatron_flops(config, train) -> float:
    """FLOPs per step as Megatron-LM counts them for its published TFLOP/s (Narayanan et al. 2021, equation 3):
    96 B s l h^2 (1 + s / 6h + V / 16lh), the transformer's and the logits' GEMMs with activation recomputation's
    extra forward pass counted."""
    b, s, L, h, v = train.global_batch, train.seq_len, config.layers, config.embed, config.vocab
    return 96.0 * b * s * L * h * h * (1 + s / (6 * h) + v / (16 * L * h))


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
    megatron_run("39.1", 8192, 64, 48, 2, 512, 1536, 4, None, 138),
    megatron_run("76.1", 10240, 80, 60, 4, 1024, 1792, 2, 5, 140),
    megatron_run("145.6", 12288, 96, 80, 8, 1536, 2304, 2, 5, 148),
    megatron_run("310.1", 16384, 128, 96, 16, 1920, 2160, 1, 3, 155),
    megatron_run("529.6", 20480, 128, 105, 35, 2520, 2520, 1, 1, 163),
    megatron_run("1008.0", 25600, 160, 128, 64, 3072, 3072, 1, None, 163),
    llama3_run(8192, 64, 32, 430, 0.43),
    llama3_run(16384, 128, 16, 400, 0.41),
)


def table() -> str:
    """The table of docs/guide/step-time.md: model, cluster, layout, published figure and source, prediction, ratio."""
    lines = ["| model | cluster (target) | layout | published | shardkit predicts | predicted / published | "
             "calibration? | source |", "|---|---|---|---|---|---|---|---|"]
    for run in RUNS:
        layout = run.layout_label()
        fmt = (lambda v: f"{v:.1%}") if run.unit == "mfu" else (lambda v: f"{v:,.3g}")
        note = f" ({run.cluster})" if run.cluster else ""
        role = "yes: `kernels.OVERHEAD` is fitted on it" if run.calibration else "no: predicted"
        lines.append(f"| {run.name} | {run.target} | {layout} | {fmt(run.figure)} {run.unit} | "
                     f"{fmt(run.predicted())} | {run.ratio():.2f} | {role} | {run.source}{note} |")
    return "\n".join(lines)


def breakdown(run: PublishedRun) -> str:
    """The run's predicted step, part by part (compute, bubble, each collective's exposed seconds), as its framework
    runs it and, where that is not shardkit, as shardkit's own pipeline would run the same layout."""
    layout, target = run.layout()
    lines = [f"{run.name} on {run.target}: {run.layout_label()}"]
    for framework in dict.fromkeys((run.framework, SHARDKIT)):
        time = step_time(layout, target, framework=framework)
        lines.append(f"  as {framework.name} runs it: step {time.total:.3f} s = compute {time.compute:.3f} + bubble "
                     f"{time.bubble:.3f} + exposed {time.exposed:.3f}")
        lines += [f"    {c.item.what} ({c.item.kind} over {'+'.join(c.item.axes)}, {c.link}): {c.seconds:.3f} s, "
                  f"exposed {c.exposed:.3f}" for c in time.comm if c.seconds > 0]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--breakdown"]:
        print("\n".join(breakdown(run) for run in RUNS if run.framework != SHARDKIT))
    else:
        print(table())
