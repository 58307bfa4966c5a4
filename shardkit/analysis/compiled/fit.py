"""Will the step fit? The compiled step's peak memory against what each device may allocate, before the first step.

The compiled peak (`shardkit.analysis.compiled.hlo.memory_stats`: arguments + outputs - donated aliases + temporaries)
is what the device really allocates: on one H100 and one H200 it equalled the measured peak
(bench/results/gpu_step_h200_*.md), and a step whose compiled peak exceeded the device's memory failed at run time. So
`train` refuses a step whose compiled peak exceeds the device's `bytes_limit` before it writes anything, and a
RESOURCE_EXHAUSTED that still happens at run time (fragmentation, another process on the GPU) becomes the same one-line
error.

GPU memory: JAX preallocates only `XLA_PYTHON_CLIENT_MEM_FRACTION` of the device's memory (0.75 by default, its
`bytes_limit`). The CLI sets it to `DEFAULT_MEM_FRACTION` before JAX starts unless the user set it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from typing import Callable, Iterator, Mapping

from shardkit.errors import ShardkitError
from shardkit.units import GIB, parse_size

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# 0.9 leaves room outside JAX's pool for the CUDA context, cuDNN/cuBLAS handles and NCCL's buffers; MaxText's and
# NVIDIA's recipes use 0.9-0.98 (a single-GPU run can take 0.95: `XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 shardkit ...`).
DEFAULT_MEM_FRACTION = "0.9"
JAX_DEFAULT_MEM_FRACTION = 0.75
# Caps the bytes shardkit assumes each device may allocate (a shared GPU; the CPU tests of this check).
MEMORY_LIMIT_ENV = "SHARDKIT_DEVICE_MEMORY"


class OutOfMemory(ShardkitError):
    """The step needs more memory per device than the device has (exit code 2, like any bad recipe)."""


def memory_fraction(environ: Mapping[str, str] | None = None) -> float:
    """The fraction JAX will preallocate: the environment's, else JAX's own default."""
    environ = os.environ if environ is None else environ
    text = environ.get(MEM_FRACTION_ENV)
    try:
        return float(text) if text else JAX_DEFAULT_MEM_FRACTION
    except ValueError:
        raise ShardkitError(MEM_FRACTION_ENV, f"must be a number such as 0.9, got {text!r}") from None


def device_memory_limit(device) -> int | None:
    """Bytes `device` may allocate: `SHARDKIT_DEVICE_MEMORY` if set, else its allocator's `bytes_limit`.

    None where the device reports no limit (CPU devices): the check is skipped there.
    """
    override = os.environ.get(MEMORY_LIMIT_ENV)
    if override:
        return parse_size(override, MEMORY_LIMIT_ENV)
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without allocator statistics raise various errors
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def remedies(recipe) -> str:
    """The recipe knobs that lower the per-device peak, each with the value to try and the current one."""
    train, mesh = recipe.train, recipe.mesh
    options = []
    if train.remat in ("none", "selective"):
        options.append(f"train.remat=full (now {train.remat})")
    if train.global_batch % (2 * train.grad_accum) == 0:
        options.append(f"train.grad_accum={2 * train.grad_accum} (now {train.grad_accum})")
    options.append(f"mesh.fsdp over more devices (now {mesh.fsdp})")
    if train.global_batch > 1:
        options.append(f"a smaller train.global_batch (now {train.global_batch})")
    return ", ".join(options[:-1]) + " or " + options[-1] if len(options) > 1 else options[0]


def fit_summary(needed: float, available: float) -> str:
    """`fits: 39.65 GiB needed of 71.28 GiB` or `does not fit: ...`, per device."""
    verdict = "fits" if needed <= available else "does not fit"
    return f"{verdict}: {needed / GIB:.2f} GiB needed of {available / GIB:.2f} GiB per device"


def check_fit(peak_bytes: int, limit: int | None, recipe, where: str) -> None:
    """Raise `OutOfMemory` naming the sizes and the knobs when the compiled peak exceeds the device's limit.

    Args:
        peak_bytes: the compiled step's peak per device.
        limit: what one device may allocate, or None to skip the check.
        recipe: the recipe, for the knobs to suggest.
        where: the device, e.g. `cuda:0 (NVIDIA H100 80GB HBM3)`.
    """
    if limit is None or peak_bytes <= limit:
        return
    raise OutOfMemory(
        "memory",
        f"the compiled step needs {peak_bytes / GIB:.2f} GiB per device but {where} can allocate "
        f"{limit / GIB:.2f} GiB; nothing was run or written. To fit, try {remedies(recipe)}",
    )


def is_out_of_memory(err: BaseException) -> bool:
    """Whether an XLA runtime error is an allocation failure."""
    return isinstance(err, RuntimeError) and "RESOURCE_EXHAUSTED" in str(err)


def out_of_memory_error(err: BaseException, recipe=None) -> OutOfMemory:
    """A runtime RESOURCE_EXHAUSTED as one line: how much could not be allocated, and the knobs that help."""
    text = str(err)
    size = re.search(r"allocate (\d+) bytes", text)
    what = f"could not allocate {int(size.group(1)) / GIB:.2f} GiB" if size else "ran out of memory"
    knobs = remedies(recipe) if recipe is not None else "train.remat=full, a larger train.grad_accum or mesh.fsdp"
    return OutOfMemory("memory", f"the device {what} at run time (XLA: RESOURCE_EXHAUSTED); try {knobs}")


@contextlib.contextmanager
def out_of_memory_as_error(recipe=None) -> Iterator[None]:
    """Turn an XLA RESOURCE_EXHAUSTED raised inside the block into `OutOfMemory`; other errors pass through."""
    try:
        yield
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
        raise out_of_memory_error(err, recipe) from None


def out_of_memory_as_one_error(fn: Callable) -> Callable:
    """Decorate a function whose first argument is the recipe: a RESOURCE_EXHAUSTED inside becomes `OutOfMemory`."""

    @functools.wraps(fn)
    def wrapper(recipe, *args, **kwargs):
        with out_of_memory_as_error(recipe):
            return fn(recipe, *args, **kwargs)

    return wrapper
