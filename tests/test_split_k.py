"""shardkit.analysis.predicted.split_k against XLA:GPU's own split-K choice.

The pure tests hold the function to the partial sums read in pp_fsdp_tp's compiled step (h100x8) and to large GEMMs,
which XLA leaves whole. The compiled test compiles plain dots deviceless for one H100 (and a few for an A100, whose
cost weights and SM count differ) and reads the split from the optimized HLO: the GEMM's output carries the split as
extra elements, `f32[split, (batch,) m, n]`, before a reduce fusion sums them (this XLA writes no `split_k` into the
fusion's backend_config). The recipe test compiles pp_fsdp_tp's step for h100x8 with XLA's HLO dumped around its
`splitk-rewriter` pass and holds the function to every dot of the step.
"""

from __future__ import annotations

import collections
import math
import re

import pytest

from shardkit.analysis.predicted.split_k import split_k_partial_sum_bytes, split_k_pieces
from shardkit.analysis.predicted.targets import GPUS, cuda_plugin_available, parse_target, target_devices
from shardkit.analysis.predicted.xla_buffers import SKIP_REASON, matches_jax

# What these tests hold follows one XLA version's buffer assignment: on another they skip rather than drift.
pytestmark = pytest.mark.skipif(not matches_jax(), reason=SKIP_REASON)


F32, BF16 = 4, 2
# pp_fsdp_tp (h100x8), one layer's backward: (m, n, k) -> the split read from the compiled step's HLO.
RECIPE_GEMMS = {
    (128, 128, 64): 4,  # gemm_fusion_dot.254 = f32[4,128,128]: the fused q/k/v projection, D = 64
    (128, 64, 128): 8,  # gemm_fusion_dot.256 = f32[8,128,64]: the down projection, F = 128
    (128, 64, 64): 4,  # gemm_fusion_dot.582 = f32[4,128,64] under 1F1B
}
# (m, n, k, dtype bytes, batch): powers of two and odd sizes from 16 to 8192, f32 and bf16, batched and not.
SWEEP = [
    *((m, n, k, F32, 1) for m, n, k in RECIPE_GEMMS),
    (16, 16, 16, F32, 1), (64, 64, 64, F32, 1), (64, 64, 128, F32, 1), (16, 128, 128, F32, 1),
    (16, 16, 1024, F32, 1), (16, 16, 8192, F32, 1), (1024, 64, 1024, F32, 1), (128, 8192, 8192, F32, 1),
    (8192, 8192, 8192, F32, 1), (4096, 4096, 4096, F32, 1), (1024, 1024, 8192, F32, 1),
    (17, 100, 333, F32, 1), (17, 333, 2049, F32, 1), (2049, 17, 2049, F32, 1), (333, 333, 100, F32, 1),
    (128, 128, 64, BF16, 1), (16, 8192, 8192, BF16, 1), (64, 1024, 8192, BF16, 1), (128, 128, 8192, BF16, 1),
    (100, 2049, 2049, BF16, 1), (8192, 8192, 1024, BF16, 1),
    (32, 32, 1024, F32, 8), (128, 128, 1024, F32, 8), (32, 1024, 4096, F32, 8), (1024, 1024, 4096, BF16, 8),
]
A100_SWEEP = [(16, 16, 1024, F32, 1), (128, 128, 1024, BF16, 1), (16, 8192, 8192, F32, 1), (128, 1024, 8192, BF16, 1)]
SHAPE = re.compile(r"= \(?(\w+)\[([\d,]*)\]")


def test_recipe_gemms_split_as_compiled():
    for (m, n, k), split in RECIPE_GEMMS.items():
        assert split_k_pieces(m, n, k, F32) == split, (m, n, k)


def test_partial_sums_are_split_times_output_in_f32():
    assert split_k_partial_sum_bytes(128, 128, 64, F32) == 4 * 128 * 128 * 4
    assert split_k_partial_sum_bytes(128, 64, 128, F32) == 8 * 128 * 64 * 4
    # bf16 operands accumulate in f32: the partial sums are twice the bf16 output's bytes per piece.
    split = split_k_pieces(128, 128, 8192, BF16)
    assert split > 1
    assert split_k_partial_sum_bytes(128, 128, 8192, BF16) == split * 128 * 128 * 4


@pytest.mark.parametrize("m, n, k, dtype_bytes", [(4096, 4096, 4096, F32), (8192, 8192, 8192, BF16),
                                                   (4096, 14336, 4096, BF16), (8192, 4096, 1024, F32)])
def test_large_gemms_are_not_split(m, n, k, dtype_bytes):
    assert split_k_pieces(m, n, k, dtype_bytes) == 1
    assert split_k_partial_sum_bytes(m, n, k, dtype_bytes) == 0


def test_split_depends_on_the_sm_count():
    """Splitting pays only while the tiles leave SMs idle: a dot 132 SMs split in two runs whole on 8 SMs."""
    assert split_k_pieces(1024, 1024, 8192, F32) == 2
    assert split_k_pieces(1024, 1024, 8192, F32, sm_count=8) == 1


def _compiled_split(target: str, m: int, n: int, k: int, dtype_bytes: int, batch: int) -> int:
    """The split XLA:GPU chose for one dot compiled deviceless: its GEMM's output elements over the dot's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(target_devices(parse_target(target))[0])
    dtype = jnp.float32 if dtype_bytes == F32 else jnp.bfloat16
    lead = (batch,) if batch > 1 else ()
    lhs = jax.ShapeDtypeStruct((*lead, m, k), dtype, sharding=sharding)
    rhs = jax.ShapeDtypeStruct((*lead, k, n), dtype, sharding=sharding)
    text = jax.jit(jnp.matmul).trace(lhs, rhs).lower().compile().as_text()
    gemm = next(line for line in text.splitlines() if " dot(" in line or "__cublas" in line)
    elements = math.prod(int(size) for size in SHAPE.search(gemm).group(2).split(",") if size)
    return elements // (batch * m * n)


@pytest.fixture(scope="module")
def compiled_splits():
    """{(target, shape): split} for every shape of both sweeps, compiled once."""
    cases = [("h100x1", shape) for shape in SWEEP] + [("a100x1", shape) for shape in A100_SWEEP]
    return {(target, shape): _compiled_split(target, *shape) for target, shape in cases}


@pytest.mark.skipif(not cuda_plugin_available(), reason="deviceless GPU compiles need the jax[cuda12] plugin")
def test_rule_matches_xla_on_h100(compiled_splits):
    got = {shape: split_k_pieces(*shape) for shape in SWEEP}
    want = {shape: compiled_splits["h100x1", shape] for shape in SWEEP}
    assert got == want
    assert sum(split > 1 for split in want.values()) >= len(SWEEP) // 2, "the sweep should exercise splitting"


@pytest.mark.skipif(not cuda_plugin_available(), reason="deviceless GPU compiles need the jax[cuda12] plugin")
def test_rule_matches_xla_on_a100(compiled_splits):
    a100 = GPUS["a100"]
    got = {shape: split_k_pieces(*shape, sm_count=a100.sm_count, compute_capability=a100.compute_capability)
           for shape in A100_SWEEP}
    assert got == {shape: compiled_splits["a100x1", shape] for shape in A100_SWEEP}


INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]")
DOT_OPERANDS = re.compile(r" dot\(%(\S+?), %(\S+?)\)")
ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def _sizes(text: str) -> list[int]:
    return [int(size) for size in text.split(",") if size]


def _dot_dims(line: str, key: str) -> list[int]:
    found = re.search(key + r"=\{([\d,]*)\}", line)
    return _sizes(found.group(1)) if found else []


def _module_dots(path) -> tuple[dict, list]:
    """An HLO dump's {instruction: (element type, sizes)} and its dot lines."""
    shapes, dots = {}, []
    for line in path.read_text().splitlines():
        found = INSTRUCTION.match(line)
        if found:
            shapes[found.group(1)] = (found.group(2), _sizes(found.group(3)))
            dots += [line] if " dot(" in line else []
    return shapes, dots


def _expected_output(line: str, shapes: dict) -> tuple[str, int]:
    """(op_name, output elements) a dot of the module before the rewrite should have after it: split x its own."""
    name = INSTRUCTION.match(line).group(1)
    lhs, rhs = (shapes[operand] for operand in DOT_OPERANDS.search(line).groups())
    lhs_batch, lhs_k = _dot_dims(line, "lhs_batch_dims"), _dot_dims(line, "lhs_contracting_dims")
    rhs_kept = _dot_dims(line, "rhs_batch_dims") + _dot_dims(line, "rhs_contracting_dims")
    batch, k = (math.prod(lhs[1][i] for i in dims) for dims in (lhs_batch, lhs_k))
    m = math.prod(size for i, size in enumerate(lhs[1]) if i not in lhs_batch + lhs_k)
    n = math.prod(size for i, size in enumerate(rhs[1]) if i not in rhs_kept)
    split = split_k_pieces(m, n, k, ELEMENT_BYTES[lhs[0]], batch, output_bytes=ELEMENT_BYTES[shapes[name][0]])
    split = split if len(lhs_k) == 1 else 1  # XLA leaves dots with several contracting dimensions whole
    return re.search(r'op_name="([^"]*)"', line).group(1), split * math.prod(shapes[name][1])


@pytest.mark.skipif(not cuda_plugin_available(), reason="deviceless GPU compiles need the jax[cuda12] plugin")
def test_rule_matches_every_dot_of_pp_fsdp_tp(tmp_path):
    """Each dot of the step before XLA's splitk-rewriter, priced by the function, becomes a dot of that many times
    its output elements after it (matched by op_name and size: one op_name may name several dots).

    The step compiles in this process, as `shardkit hlo recipes/pp_fsdp_tp.toml --target h100x8` compiles it (the
    recipe's compiler options), with XLA's dump options added to that one compile: compile options are part of the
    compile's cache key, so the program is compiled afresh (a cached program runs no passes, so dumps nothing)."""
    from shardkit.layout import build_layout
    from shardkit.recipe import load_recipe
    from shardkit.step import build_step
    from shardkit.xla_flags import compiler_options

    layout = build_layout(load_recipe("recipes/pp_fsdp_tp.toml", []), target_devices(parse_target("h100x8")))
    options = (compiler_options(layout.recipe, layout.mesh) or {}) | {
        "xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "splitk-rewriter"}
    build_step(layout).lower().compile(compiler_options=options)
    before, after = (_module_dots(path) for path in sorted(tmp_path.glob("*splitk-rewriter*.txt")))
    expected = collections.Counter(_expected_output(line, before[0]) for line in before[1])
    compiled = collections.Counter(
        (re.search(r'op_name="([^"]*)"', line).group(1), math.prod(after[0][INSTRUCTION.match(line).group(1)][1]))
        for line in after[1])
    assert compiled == expected
    unsplit = {INSTRUCTION.match(line).group(1) for line in before[1]}
    split_dots = [line for line in after[1] if INSTRUCTION.match(line).group(1) not in unsplit]
    assert len(split_dots) >= 20, "pp_fsdp_tp's step should have its q/k/v, down-projection and other dots split"
