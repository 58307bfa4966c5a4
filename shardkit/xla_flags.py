"""XLA compiler flags for GPU compiles: shardkit's defaults, with the recipe's `[xla] flags` over them; and the
options of programs a run compiles and runs once (`run_once_options`).

They are passed per compile (`Lowered.compile(compiler_options=...)`, XLA's DebugOptions for that one program), not
through the XLA_FLAGS environment variable: they then apply to the training step only, reach `--target` compiles on
a CPU machine as well, and a misspelt flag is an error naming `xla.flags` instead of XLA aborting the process.
The user's own XLA_FLAGS still apply underneath (a flag given here wins).

Defaults are kept only where a flag is required or shown harmless; none of them was measured on a GPU in this
project yet (no GPU was lent to the session that added them):

- `xla_gpu_enable_command_buffer` without `CUDNN`: XLA's command buffers (CUDA graphs) capture cuDNN fused attention
  too, and that capture fails across several GPUs with cuDNN attention under shard_map ("Failed to capture gpu
  graph", jax-ml/jax#27599, open) and drops the output zero-fill of padded fMHA (openxla/xla#46500, open). Keeping
  cuDNN calls out of the graphs only launches them one by one; the other commands stay captured.

- `xla_gpu_reduce_scatter_combine_threshold_bytes=8388608` (2**23 bytes): XLA otherwise combines a layer's gradient
  reduce-scatters into a few large ones issued at the end of the backward loop body, where nothing is left to hide
  them behind; smaller ones start as each gradient is ready. The exposed-communication report
  (shardkit.analysis.predicted.overlap) of the 8b step on h100x8 shows less exposed time under fsdp and fsdp_tp for the
  same bytes, and no change under zero1 and pp_fsdp_tp (bench/results/overlap_flags_h100x8_*.md). A prediction from the
  compiled schedule, not a GPU measurement.

Compared the same way and left out (bench/results/overlap_flags_h100x8_*.md has the table): the latency-hiding scheduler
flag (XLA already runs it at its default optimization effort: the schedule is identical with it on or off), while-loop
double buffering (no change or worse), pipelined all-gather / all-reduce / reduce-scatter (each helps one layout and
costs another: the pipeliner's copies of the carried buffers add compute), an all-gather combine threshold of a
layer (one gather per layer that nothing can hide), windowed einsum (no change: these layouts' tensor-parallel
collectives are all-reduces).

Not defaults (unmeasured, or measured to hurt): `--xla_gpu_enable_triton_gemm=false` together with
`--xla_gpu_enable_latency_hiding_scheduler=true` made the 1b step slower on one H100. Flags worth measuring for
multi-GPU layouts are listed in docs/guide/gpus.md.
"""

from __future__ import annotations

import re
from typing import Mapping

from shardkit.errors import ShardkitError
from shardkit.platforms import mesh_platform, on_gpu

# XLA's default command buffer types (debug_options_flags.cc) less CUDNN; the flag takes a whole list ("-CUDNN" is
# refused by the per-compile option parser of jax 0.10.2).
COMMAND_BUFFER_WITHOUT_CUDNN = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,DYNAMIC_SLICE_FUSION"
# Overlap of communication with compute, each kept where `bench/overlap.py` shows a shorter predicted
# step (compute + exposed communication) for the same collective bytes; see the module docstring.
OVERLAP_DEFAULTS: Mapping[str, str | bool] = {"xla_gpu_reduce_scatter_combine_threshold_bytes": str(8 * 2**20)}
GPU_DEFAULTS: Mapping[str, str | bool] = {"xla_gpu_enable_command_buffer": COMMAND_BUFFER_WITHOUT_CUDNN,
                                          **OVERLAP_DEFAULTS}
# The fp8 precision policy's matmuls as cuBLASLt FP8 GEMMs (custom calls __cublas$lt$matmul$f8), NVIDIA's JAX-Toolbox
# setting for FP8 training: with Triton GEMMs on, XLA's GEMM fusion takes the FP8 dots first, and where it cannot
# autotune (a --target compile on a CPU machine) they stay Triton kernels. Not measured on a GPU in this project.
FP8_DEFAULTS: Mapping[str, str | bool] = {"xla_gpu_enable_triton_gemm": False}
# A program a run compiles and runs once (the parameters' initialisation) on XLA:CPU: LLVM's optimisation of its
# machine code (threefry's rounds for every parameter) takes many times longer than running it unoptimised, so it
# is skipped. Its HLO passes, sharding and partitioning are XLA's as usual; values may differ from an optimised
# compile's in the last bits of a float (the integer random bits are the same).
RUN_ONCE_CPU_OPTIONS: Mapping[str, int] = {"xla_backend_optimization_level": 0}
_FLAG = re.compile(r"(?:--)?(xla_[a-z0-9_]+)=(.*)")


def parse_flags(flags: tuple[str, ...] | list[str], field: str = "xla.flags") -> dict[str, str | bool]:
    """`["--xla_gpu_enable_latency_hiding_scheduler=true", ...]` (XLA_FLAGS form) -> {name: value}.

    `true`/`false` become Python booleans: the per-compile option parser takes no other spelling of a bool flag.

    Raises:
        ShardkitError: an entry is not `--xla_<name>=<value>`, or names a flag twice.
    """
    parsed: dict[str, str] = {}
    for flag in flags:
        match = _FLAG.fullmatch(flag.strip())
        if not match:
            raise ShardkitError(field, f"{flag!r} is not an XLA flag; write it as in XLA_FLAGS, e.g. "
                                       "'--xla_gpu_enable_latency_hiding_scheduler=true'")
        name, value = match.groups()
        if name in parsed:
            raise ShardkitError(field, f"{name} is given twice")
        parsed[name] = {"true": True, "false": False}.get(value.lower(), value)
    return parsed


def gpu_flags(xla_section, fp8: bool = False) -> dict[str, str | bool]:
    """The flags a GPU compile of this recipe gets: the defaults (unless `gpu_defaults = false`; with `fp8`, the fp8
    policy's too), then the recipe's."""
    defaults = dict(GPU_DEFAULTS) | (dict(FP8_DEFAULTS) if fp8 else {}) if xla_section.gpu_defaults else {}
    return defaults | parse_flags(xla_section.flags)


def compiler_options(recipe, mesh) -> dict[str, str | bool] | None:
    """`compiler_options` for compiling `recipe`'s step on `mesh`: the GPU flags on GPUs, None elsewhere."""
    if not on_gpu(mesh):
        return None
    return gpu_flags(recipe.xla, recipe.precision.parsed.fp8) or None


def compile_lowered(lowered, recipe, mesh):
    """`lowered.compile()` with the recipe's compiler options; XLA refusing a flag is a ShardkitError naming
    `xla.flags` (XLA checks names and values: "No such compile option", "not a valid enum value")."""
    options = compiler_options(recipe, mesh)
    try:
        return lowered.compile(compiler_options=options)
    except RuntimeError as err:
        text = str(err)
        if options and ("No such compile option" in text or "While setting option" in text):
            raise ShardkitError("xla.flags", f"XLA refused a flag: {text.splitlines()[0]}") from None
        raise


def run_once_options(mesh) -> dict[str, int] | None:
    """`compiler_options` for a program compiled and run once on `mesh`: RUN_ONCE_CPU_OPTIONS on XLA:CPU, XLA's
    defaults elsewhere."""
    return dict(RUN_ONCE_CPU_OPTIONS) if mesh_platform(mesh) == "cpu" else None
