"""Which attention kernel runs: the one place that decides it, with the one table of what cuDNN accepts.

Every forward pass (training, evaluation, generation, a pipeline stage, a context-parallel block) runs the kernel
that `choose_kernel` picked when the layout was resolved (`shardkit.layout.Layout.attention`); `estimate`, `remat`
and `plan` read the same choice. `train.attention` asks for it:

    auto   cuDNN's fused flash attention wherever it can run, else XLA's (one warning when only the cuDNN library is
           missing: that is a broken install, not a property of the model)
    cudnn  cuDNN or a one-line error naming why it cannot run
    xla    XLA's attention (the S x S scores in memory)

What cuDNN accepts (`CUDNN`): NVIDIA GPUs with the cuDNN library loadable, bf16 or fp16 inputs, head_dim a multiple
of 8 up to 256 on Hopper and later, 128 before; causal or no mask. JAX's public `jax.nn.dot_product_attention` reads
the compute capability from the process's own backend, so a deviceless `--target` compile on a CPU process is held
to the pre-Hopper 128 (`tests/test_attention_kernel.py` checks the table against JAX's lowering on the h100 target).

Packed documents (`data.packing = "documents"`) run cuDNN's packed layout (`shardkit.attention.packed`): cuDNN >= 9.6
and Hopper or later, the target's devices deciding (its primitives are bound directly, so a deviceless target is
held to the target's own limits). Under ring context parallelism they keep the XLA block kernel: the packed layout
cannot express a block whose queries continue a document from an earlier block.

JAX's cuDNN primitives and its cuDNN version probe are private (`jax._src.cudnn`, `jax._src.lib.cuda_versions`):
they are reached through `cudnn_module` and `cudnn_version` here and nowhere else. The packed layout binds JAX's
unwrapped primitives with the operands and keywords of the JAX shardkit is tested on (`PACKED_BINDS`); a JAX whose
primitives take others runs packed rows on XLA's kernel, with one warning (`packed_primitives_differ`), not a crash.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import warnings

import jax
import jax.numpy as jnp

from shardkit.errors import ShardkitError
from shardkit.platforms import GPU_PLATFORMS

MODES = ("auto", "cudnn", "xla")
KERNELS = ("cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class CudnnLimits:
    """What cuDNN's fused flash attention (bf16/fp16, JAX's `dot_product_attention`) accepts."""

    dtypes: tuple = (jnp.bfloat16, jnp.float16)
    head_dim_multiple: int = 8
    head_dim_max_hopper: int = 256  # compute capability >= 9.0
    head_dim_max_before_hopper: int = 128
    masks: tuple = ("causal", "none")
    # Packed documents: cuDNN's packed ("ragged") layout, per row each document's start and length (JAX 0.10.2's
    # public API takes a segment mask only as a dense S x S bias, which gives up the flash kernel's memory saving).
    # JAX binds it from cuDNN 9.6 on, and only on Hopper or later (`check_is_flash_attention`).
    packed_min_version: int = 90600
    packed_needs_hopper: bool = True

    def head_dim_max(self, hopper: bool) -> int:
        return self.head_dim_max_hopper if hopper else self.head_dim_max_before_hopper


CUDNN = CudnnLimits()


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernel attention runs on and why (printed by `plan`, written in `hlo`'s summary)."""

    kernel: str
    reason: str

    @property
    def fused(self) -> bool:
        return self.kernel == "cudnn"


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the kernel choice needs to know of the devices: NVIDIA GPUs, Hopper or later, seen by this process (a
    real GPU) or only compiled for (a `--target` topology on a CPU process)."""

    nvidia_gpu: bool = False
    hopper: bool = False
    process_sees_gpu: bool = False


def platform_of(device) -> Platform:
    """The platform of a device: a real one, or a compile-only device of a GPU target."""
    if device.platform not in GPU_PLATFORMS:
        return Platform()
    kind = f"{device.device_kind} {getattr(device.client, 'platform_version', '')}".lower()
    if "nvidia" not in kind and "cuda" not in kind:
        return Platform()
    capability = getattr(device, "compute_capability", None)
    hopper = (_at_least_hopper(capability) if capability
              else any(name in kind for name in ("h100", "h200", "gh200", "b200")))
    return Platform(nvidia_gpu=True, hopper=hopper, process_sees_gpu=_process_sees_gpu())


def _at_least_hopper(capability: str) -> bool:
    return tuple(int(x) for x in str(capability).split(".")[:2]) >= (9, 0)


def _process_sees_gpu() -> bool:
    import jax.extend

    try:
        return "cuda" in jax.extend.backend.get_backend().platform_version
    except RuntimeError:
        return False


def cudnn_module():
    """JAX's private cuDNN attention module (`jax._src.cudnn.fused_attention_stablehlo`): its primitives serve the
    block kernels. `tests/test_attention_kernel.py` fails loudly when JAX moves it."""
    return importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")


# What `shardkit.attention.packed` binds JAX's unwrapped cuDNN primitives with: each primitive's abstract evaluation
# rule and its parameters, the operands then the keywords, as the JAX versions shardkit is tested on name them.
_OPERANDS = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
             "page_table_v")
_KEYWORDS = ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout", "sliding_window_length")
PACKED_BINDS = {
    "_dot_product_attention_fwd_p": ("_dot_product_attention_fwd_abstract", _OPERANDS + _KEYWORDS + ("is_training",)),
    "_dot_product_attention_bwd_p": ("_dot_product_attention_bwd_abstract",
                                     _OPERANDS + ("activation", "fwd_output", "grad_output") + _KEYWORDS),
}


def packed_primitives_differ() -> str | None:
    """How this JAX's private cuDNN primitives differ from what the packed layout binds (`PACKED_BINDS`), or None when
    they match. Read from the primitives' abstract evaluation rules, which name every operand and keyword."""
    try:
        module = cudnn_module()
    except ImportError:
        return "jax._src.cudnn.fused_attention_stablehlo is gone"
    for primitive, (rule, expected) in PACKED_BINDS.items():
        if not hasattr(module, primitive) or not callable(getattr(module, rule, None)):
            return f"{primitive} or its rule {rule} is gone"
        try:
            names = tuple(inspect.signature(getattr(module, rule)).parameters)
        except (TypeError, ValueError):
            return f"{rule}'s parameters cannot be read"
        if names != expected:
            at = next((i for i, (a, b) in enumerate(zip(names, expected)) if a != b), min(len(names), len(expected)))
            found = names[at] if at < len(names) else "nothing"
            wanted = expected[at] if at < len(expected) else "nothing"
            return f"{primitive} takes {found} where shardkit binds {wanted} (parameter {at + 1})"
    return None


def cudnn_version() -> int | None:
    """cuDNN's version as JAX's own check reads it, or None when the library cannot be loaded ("cuDNN not found")."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except (RuntimeError, OSError):
        return None


@functools.lru_cache(maxsize=256)
def cudnn_rejects(platform: Platform, dtype, head_dim: int | None, causal: bool = True,
                  packed: bool = False) -> str | None:
    """Why cuDNN's fused attention cannot run these inputs on this platform, or None when it can. The library probe
    is separate (`cudnn_version`): a missing library is a broken install, not a property of the inputs. `packed`:
    the rows are packed documents, which run cuDNN's packed layout (bound directly: the target's limits hold)."""
    if not platform.nvidia_gpu:
        return "the devices are not NVIDIA GPUs (a GPU target, --target h100x8, compiles for them)"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN.dtypes]:
        return f"it needs bf16 or fp16 compute, not {jnp.dtype(dtype).name} (precision.policy)"
    if ("causal" if causal else "none") not in CUDNN.masks:
        return "it supports causal or unmasked attention only"
    if packed and CUDNN.packed_needs_hopper and not platform.hopper:
        return ("packed documents (data.packing = 'documents') need cuDNN's packed layout, which runs on Hopper "
                "(compute capability 9.0) or later")
    limit = CUDNN.head_dim_max(platform.hopper and (platform.process_sees_gpu or packed))
    if head_dim is not None and (head_dim > limit or head_dim % CUDNN.head_dim_multiple):
        deviceless = platform.hopper and not (platform.process_sees_gpu or packed)
        where = " (JAX checks a deviceless GPU target as pre-Hopper)" if deviceless else ""
        return f"it needs head_dim <= {limit} and a multiple of {CUDNN.head_dim_multiple}, not {head_dim}{where}"
    return None


def choose_kernel(mode: str, platform: Platform, dtype, head_dim: int | None, causal: bool = True,
                  packed: bool = False, version_probe=cudnn_version, ring: bool = False,
                  packed_probe=None) -> KernelChoice:
    """The kernel for `train.attention = mode` on these inputs (`packed`: rows of packed documents; `ring`: under
    ring context parallelism), with the reason. `packed_probe` (default `packed_primitives_differ`, looked up at call
    time) says how JAX's packed primitives differ from what shardkit binds; under `auto` a difference runs XLA's
    kernel with one warning.

    Raises:
        ShardkitError: on `train.attention` when the mode is unknown, or `cudnn` cannot run here.
    """
    if mode not in MODES:
        raise ShardkitError("train.attention", f"must be one of {list(MODES)}, got {mode!r}")
    if mode == "xla":
        return KernelChoice("xla", "train.attention = 'xla'")
    if packed and ring:
        return KernelChoice("xla", "packed documents under ring context parallelism run the XLA block kernel: cuDNN's "
                            "packed layout cannot express a block whose queries continue an earlier block's document "
                            "(train.context = 'allgather' runs them on cuDNN)")
    reason = cudnn_rejects(platform, dtype, head_dim, causal, packed)
    version = version_probe() if reason is None else None
    if reason is None and version is not None and packed and version < CUDNN.packed_min_version:
        reason = (f"packed documents need cuDNN >= {_dotted(CUDNN.packed_min_version)} for its packed layout, "
                  f"found {_dotted(version)} (pip install -U nvidia-cudnn-cu12)")
    if reason is None and version is not None and packed:
        reason = _packed_primitives_reason(mode, packed_probe or packed_primitives_differ)
    if reason is None and version is None:
        reason = ("the cuDNN library cannot be loaded (reinstall it: pip install --force-reinstall --no-deps "
                  "nvidia-cudnn-cu12)")
        if mode == "auto":
            # Issued from this one line, so Python's default filter shows it once per process however many layouts
            # resolve.
            warnings.warn(f"attention: cuDNN fused attention is unavailable, running XLA's: {reason}", stacklevel=1)
    if mode == "cudnn" and reason is not None:
        raise ShardkitError("train.attention", f"'cudnn' cannot run here: {reason}; use 'auto' or 'xla'")
    if reason is not None:
        return KernelChoice("xla", f"train.attention = 'auto' and cuDNN cannot run: {reason}")
    head = f"head_dim {head_dim}" if head_dim is not None else "the queries' head_dim, checked per call"
    packing = "packed documents on cuDNN's packed layout, one slot per document: " if packed else ""
    accepts = f"train.attention = {mode!r} and cuDNN accepts {jnp.dtype(dtype).name}, {head}"
    return KernelChoice("cudnn", packing + accepts)


def _packed_primitives_reason(mode: str, probe) -> str | None:
    """Why packed rows cannot bind this JAX's primitives, warned once per process under `auto`, or None."""
    differ = probe()
    if differ is None:
        return None
    reason = (f"JAX {jax.__version__}'s private cuDNN packed primitives differ from what shardkit binds ({differ}); "
              f"shardkit is tested with the jax versions pyproject.toml allows")
    if mode == "auto":
        # One line, so Python's default filter shows it once per process however many layouts resolve.
        warnings.warn(f"attention: packed documents run XLA's kernel: {reason}", stacklevel=1)
    return reason


def _dotted(version: int) -> str:
    """cuDNN's integer version (90600) as 9.6.0."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
