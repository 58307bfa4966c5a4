"""Packed documents on cuDNN's packed layout (shardkit/attention/packed.py).

- `document_slots`, the offsets and lengths cuDNN reads, against a plain Python description of the documents: whole
  rows and the windows of all-gather context parallelism, one document, many, more than the slots, one-token
  documents at the row's ends, random rows.
- JAX's private packed call: its signature and what it returns, checked abstractly (no GPU), so a JAX that moves or
  changes it fails here first.
- On the CPU: the regions and custom VJPs run with the fallback kernel (XLA's chunked kernel, what rows of more
  documents than slots run on a GPU) and equal `reference_attention` with the segment mask, forward and gradients
  (fp32, 1e-5 relative plus 1e-5 of the largest entry, as test_attention.py): whole rows in a region manual over a
  data x tensor mesh, inside a pipeline stage, and all-gather context parallelism's placed queries.
- A JAX whose private packed primitives take other operands or keywords than shardkit binds (simulated by replacing
  the primitive's abstract rule with a newer signature) runs packed rows on XLA's kernel with one warning, refuses an
  explicit `train.attention = "cudnn"` in one line, and (with the plugin) compiles for h100x8 without cuDNN's call.
- With the CUDA plugin (deviceless h100x8): packed rows compile to cuDNN's fused forward and backward under fsdp,
  pp_fsdp_tp and all-gather context parallelism, and the layout names the kernel.
"""

from __future__ import annotations

import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from shardkit.analysis.predicted.targets import cuda_plugin_available, parse_target, target_devices
from shardkit.attention.kernel import CUDNN, Platform, choose_kernel, cudnn_module, packed_primitives_differ
from shardkit.attention.packed import (
    document_slots,
    gathered_packed_attention,
    max_documents,
    packed_region_attention,
)
from shardkit.attention.reference import reference_attention
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.mesh import build_mesh
from shardkit.recipe import MeshSection
from shardkit.step import build_step
from tests.helpers import recipe

FP32_RTOL = 1e-5
needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason='needs the jax[cuda12] plugin: pip install "jax[cuda12]==0.10.2"')


# ---- the offsets and lengths --------------------------------------------------------------------------------------
def _segments(lengths_per_row, length):
    """Segment ids of rows cut into documents of the given lengths (ids need not start at 0 or step by 1)."""
    rows = [np.repeat(np.arange(len(row)) * 3 + 7, row) for row in lengths_per_row]
    assert all(len(row) == length for row in rows)
    return jnp.asarray(np.stack(rows), jnp.int32)


def _expected(lengths, slots, lo, hi):
    """(offsets, lengths, fits) of one row's documents touching [lo, hi), each cut at hi, as cuDNN should read them."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    spans = [(s, min(s + n, hi) - s) for s, n in zip(starts, lengths) if s < hi and s + n > lo]
    fits = len(spans) <= slots
    spans = spans[:slots] if fits else spans[:0]
    offsets = [s for s, _ in spans] + [-1] * (slots + 1 - len(spans))
    return offsets, [n for _, n in spans] + [-1] * (slots - len(spans)), fits


def _check_slots(lengths_per_row, slots, lo=0, hi=None):
    length = sum(lengths_per_row[0])
    hi = length if hi is None else hi
    got = document_slots(_segments(lengths_per_row, length), slots, lo, hi)
    for row, lengths in enumerate(lengths_per_row):
        offsets, sizes, fits = _expected(lengths, slots, lo, hi)
        assert bool(got.fits_B[row]) == fits, (lengths, lo, hi)
        if fits:
            assert got.offsets_BM1[row].tolist() == offsets, (lengths, lo, hi)
            assert got.lengths_BM[row].tolist() == sizes, (lengths, lo, hi)
            covered = np.zeros(length, bool)
            for start, size in zip(offsets, sizes):
                covered[start:start + size] = start >= 0
            assert got.covered_BS[row].tolist() == covered.tolist()


def test_slots_of_one_document_many_and_one_token_ends():
    _check_slots([[16], [3, 5, 8], [1, 14, 1], [4, 4, 4, 4]], slots=4)


def test_slots_always_end_in_a_minus_one_column():
    """JAX reads M as the offsets' columns minus one: the extra column is -1 even when every slot is used."""
    got = document_slots(_segments([[4, 4, 4, 4]], 16), 4)
    assert got.offsets_BM1.tolist() == [[0, 4, 8, 12, -1]] and got.lengths_BM.tolist() == [[4, 4, 4, 4]]


def test_a_row_of_more_documents_than_slots_does_not_fit():
    got = document_slots(_segments([[2] * 8, [16]], 16), 4)
    assert got.fits_B.tolist() == [False, True]


def test_windows_start_each_slot_at_its_documents_start_and_cut_it_at_the_window():
    for lo, hi in [(0, 4), (4, 8), (8, 12), (12, 16)]:
        _check_slots([[16], [3, 5, 8], [1, 14, 1], [6, 2, 2, 6]], slots=3, lo=lo, hi=hi)


def test_random_rows_match_their_documents():
    rng = np.random.default_rng(0)
    for _ in range(8):
        rows = []
        for _ in range(3):
            cuts = np.sort(rng.choice(np.arange(1, 32), size=rng.integers(0, 9), replace=False))
            rows.append(np.diff(np.concatenate([[0], cuts, [32]])).tolist())
        lo = int(rng.integers(0, 4)) * 8
        _check_slots(rows, slots=int(rng.integers(2, 8)), lo=lo, hi=lo + 8)
        _check_slots(rows, slots=int(rng.integers(2, 8)))


def test_the_slot_count_grows_with_the_row_and_never_reads_as_unpacked():
    assert max_documents(16) == 2 and max_documents(4096) == 18 and max_documents(8192) == 34


# ---- JAX's private packed call ------------------------------------------------------------------------------------
def test_jax_private_packed_call_still_takes_and_returns_what_shardkit_binds():
    """Fails loudly when JAX moves or changes the packed call: its signature, its slot count read off the offsets'
    columns, its mask enum, and the shapes its primitives return for packed operands (abstractly, on the CPU)."""
    module = cudnn_module()
    params = list(inspect.signature(module.dot_product_attention).parameters)
    assert params[:9] == ["query", "key", "value", "bias", "mask", "q_seqlen", "kv_seqlen", "q_offsets",
                          "kv_offsets"], f"jax's packed cuDNN call changed: {params}; update attention/packed.py"
    assert module.get_max_seg_per_batch(jnp.zeros((2, 5), jnp.int32)) == 4
    assert {"CAUSAL", "NO_MASK"} <= set(module.MaskType.__members__)
    from shardkit.attention.blocks import cudnn_options
    from shardkit.attention.packed import _packed_operands, cudnn_ragged

    batch, length, heads, kv_heads, head_dim, slots = 2, 64, 4, 2, 64, 3
    q = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), jnp.bfloat16)
    got = document_slots(jnp.zeros((batch, length), jnp.int32), slots)
    ragged = cudnn_ragged(got.lengths_BM, got.offsets_BM1, length, length, heads * head_dim, kv_heads * head_dim)
    operands = lambda q, k: _packed_operands(q.dtype, ragged)
    forward = lambda q, k, v: module._dot_product_attention_fwd_p.bind(
        q, k, v, *operands(q, k), is_training=True, **cudnn_options(head_dim, True))
    out, stats = jax.eval_shape(forward, q, kv, kv)
    assert out.shape == q.shape and stats.shape == (batch * slots, heads, length) and stats.dtype == jnp.float32
    backward = lambda q, k, v, stats, out, dout: module._dot_product_attention_bwd_p.bind(
        q, k, v, *operands(q, k), stats, out, dout, **cudnn_options(head_dim, True))
    grads = jax.eval_shape(backward, q, kv, kv, stats, out, q)
    assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]


def test_cudnn_reads_every_slot_in_row_order_with_each_tensors_own_stride():
    """B * M sequences, unused slots empty at their row's end; offsets in elements, the keys' by their own heads;
    per device where the rows are split over devices."""
    from shardkit.attention.packed import cudnn_ragged

    lengths = jnp.array([[3, 2, 3], [8, -1, -1]], jnp.int32)
    offsets = jnp.array([[0, 3, 5, -1], [0, -1, -1, -1]], jnp.int32)
    sizes, q_offsets, kv_offsets = cudnn_ragged(lengths, offsets, 8, 8, 4 * 16, 2 * 16)
    assert sizes.tolist() == [[3, 2, 3], [8, 0, 0]]
    tokens = [[0, 3, 5, 8], [16, 16, 16, 16]]  # flattened, entry B * M = 6 is the end, 16 tokens
    assert (q_offsets // 64).tolist() == tokens and (kv_offsets // 32).tolist() == tokens
    # One row a device: each device's offsets are its own row's, ended by its own end.
    _, q_offsets, _ = cudnn_ragged(lengths, offsets, 8, 8, 1, 1, shard_rows=1)
    assert q_offsets.tolist() == [[0, 3, 5, 8], [0, 8, 8, 8]]


def test_the_table_takes_packed_rows_on_hopper_with_cudnn_9_6_only():
    hopper, ampere = Platform(True, True, False), Platform(True, False, False)
    choose = lambda platform, version, **kw: choose_kernel("auto", platform, jnp.bfloat16, 64, packed=True,
                                                           version_probe=lambda: version, **kw)
    assert CUDNN.packed_min_version == 90600
    assert choose(hopper, 90600).kernel == "cudnn" and "packed" in choose(hopper, 90600).reason
    assert "9.6.0" in choose(hopper, 90500).reason and choose(hopper, 90500).kernel == "xla"
    assert "Hopper" in choose(ampere, 90600).reason
    ring = choose(hopper, 90600, ring=True)
    assert ring.kernel == "xla" and "ring" in ring.reason
    # A deviceless Hopper target keeps its own head_dim limit for packed rows (the primitives are bound directly).
    assert choose_kernel("auto", hopper, jnp.bfloat16, 256, packed=True, version_probe=lambda: 90600).fused


def _newer_forward_rule(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k,
                        page_table_v, *, scale, seed, dropout_rate, variadic_args, mask_type, layout,
                        sliding_window_length, is_training, return_residual=False):
    """The forward rule of a JAX that added a keyword to the primitive (its binding without it would fail)."""
    raise AssertionError("a differing primitive is never bound")


@pytest.fixture
def differing_jax(monkeypatch):
    monkeypatch.setattr(cudnn_module(), "_dot_product_attention_fwd_abstract", _newer_forward_rule)


def test_this_jax_has_the_packed_primitives_shardkit_binds():
    assert packed_primitives_differ() is None, "update shardkit.attention.kernel.PACKED_BINDS and attention/packed.py"


def test_a_jax_whose_packed_primitives_differ_runs_xla_with_one_warning(differing_jax):
    hopper = Platform(True, True, False)
    choose = lambda mode, packed=True: choose_kernel(mode, hopper, jnp.bfloat16, 64, packed=packed,
                                                     version_probe=lambda: 90600)
    assert "return_residual where shardkit binds nothing" in packed_primitives_differ()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        choices = [choose("auto"), choose("auto")]
    assert [c.kernel for c in choices] == ["xla", "xla"] and "packed primitives differ" in choices[0].reason
    assert len(caught) == 1 and "packed documents run XLA's kernel" in str(caught[0].message), caught
    with pytest.raises(ShardkitError, match="packed primitives differ") as refused:
        choose("cudnn")
    assert refused.value.field == "train.attention"
    assert choose("auto", packed=False).kernel == "cudnn"  # unpacked rows bind the wrapped primitives, unchanged


@pytest.mark.slow
@needs_plugin
def test_a_jax_whose_packed_primitives_differ_compiles_packed_rows_without_cudnn(differing_jax):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        choice, calls = _compiled_cudnn_calls("fsdp")
    assert choice.kernel == "xla" and "packed primitives differ" in choice.reason, choice
    assert not calls, calls


# ---- the regions and custom VJPs, on the fallback kernel (CPU) ----------------------------------------------------
def _qkv(batch=4, seq=32, kv_heads=2, groups=2, head_dim=8):
    k_q, k_k, k_v, k_o = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(k_q, (batch, seq, kv_heads, groups, head_dim))
    k = jax.random.normal(k_k, (batch, seq, kv_heads, head_dim))
    v = jax.random.normal(k_v, (batch, seq, kv_heads, head_dim))
    return q, k, v, jax.random.normal(k_o, q.shape)


SEGMENTS = _segments([[32], [5, 11, 16], [1, 30, 1], [4] * 8], 32)  # the last row: more documents than 2 slots


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=FP32_RTOL, atol=FP32_RTOL * np.abs(w).max())


def _check_against_reference(attend):
    q, k, v, cotangent = _qkv()
    loss = lambda fn: lambda q, k, v: (fn(q, k, v) * cotangent).sum()
    reference = lambda q, k, v: reference_attention(q, k, v, True, SEGMENTS)
    _assert_close(jax.jit(attend)(q, k, v), reference(q, k, v))
    _assert_close(jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2)))(q, k, v),
                  jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v))


def test_whole_rows_in_their_region_equal_reference_attention():
    mesh = build_mesh(MeshSection(data=2, tensor=2, fsdp=2))
    kv_spec = PartitionSpec(("data", "fsdp"), None, "tensor", None)
    _check_against_reference(lambda q, k, v: packed_region_attention(q, k, v, SEGMENTS, True, kv_spec, mesh, "xla"))


def test_whole_rows_inside_a_pipeline_stage_equal_reference_attention():
    mesh = build_mesh(MeshSection(pipeline=2, data=2, tensor=2))
    kv_spec = PartitionSpec("data", None, "tensor", None)
    q_spec, k_spec, s_spec = PartitionSpec("data"), PartitionSpec("data"), PartitionSpec("data")

    def stage(q, k, v, segments):
        return packed_region_attention(q, k, v, segments, True, kv_spec, implementation="xla")

    staged = jax.shard_map(stage, mesh=mesh, in_specs=(q_spec, k_spec, k_spec, s_spec), out_specs=q_spec,
                           axis_names={"pipeline", "data"})
    _check_against_reference(lambda q, k, v: staged(q, k, v, SEGMENTS))


def test_all_gather_context_parallelism_places_its_queries_exactly():
    mesh = build_mesh(MeshSection(sequence=4, data=2))
    spec = PartitionSpec("data", "sequence")

    def block(q, k, v, segments):
        return gathered_packed_attention(q, k, v, segments, "sequence", implementation="xla")

    cp = jax.shard_map(block, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec)
    _check_against_reference(lambda q, k, v: cp(q, k, v, SEGMENTS))


# ---- the compiled GPU program (compile-only devices of h100x8; needs the CUDA plugin) -----------------------------
def _compiled_cudnn_calls(name: str, *overrides: str):
    layout = build_layout(recipe(name, "precision.policy=bf16", "data.packing=documents", "data.eos_id=1",
                                 "model.head_dim=64", "train.seq_len=256", *overrides),
                          target_devices(parse_target("h100x8")))
    text = build_step(layout).compile().as_text()
    calls = set(re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', text))
    return layout.attention.choice, calls


@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("name, overrides", [
    ("fsdp", ()),
    ("pp_fsdp_tp", ("model.layers=2",)),
    ("cp", ("train.context=allgather",)),
])
def test_packed_rows_compile_to_cudnn_fused_attention_for_h100(name, overrides):
    choice, calls = _compiled_cudnn_calls(name, *overrides)
    assert choice.kernel == "cudnn" and choice.reason.startswith("packed documents on cuDNN's packed layout"), choice
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= calls, calls


# ---- on a Hopper GPU (whoever has one runs these; skipped elsewhere) ----------------------------------------------
def _hopper_with_packed_cudnn() -> bool:
    from shardkit.attention.kernel import cudnn_version, platform_of

    device = jax.devices()[0]
    return platform_of(device).hopper and device.platform == "gpu" and (cudnn_version() or 0) >= 90600


needs_hopper = pytest.mark.skipif(not _hopper_with_packed_cudnn(), reason="needs a Hopper GPU with cuDNN >= 9.6")
BF16_RTOL = 2e-2  # bf16 inputs and output against the fp32 reference of the same bf16 inputs


@needs_hopper
@pytest.mark.parametrize("lengths", [
    [[512], [100, 300, 112], [1, 510, 1], [200, 312]],  # every row fits its 4 slots: cuDNN's packed kernel
    [[512], [64] * 8, [1, 510, 1], [200, 312]],  # a row of 8 documents: the call takes the XLA fallback
], ids=["cudnn", "fallback"])
def test_cudnn_packed_attention_equals_the_masked_reference_on_a_gpu(lengths):
    """Grouped-query heads (2 kv heads x 4), head_dim 64, seq 512 (M = 4 slots), forward and gradients."""
    segments = _segments(lengths, 512)
    q, k, v, cotangent = (x.astype(jnp.bfloat16) for x in _qkv(batch=4, seq=512, kv_heads=2, groups=4, head_dim=64))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    packed = lambda q, k, v: packed_region_attention(q, k, v, segments, True, None, mesh)
    reference = lambda q, k, v: reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), True, segments)
    loss = lambda fn: lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * cotangent.astype(jnp.float32)).sum()
    got = [jax.jit(packed)(q, k, v), *jax.jit(jax.grad(loss(packed), argnums=(0, 1, 2)))(q, k, v)]
    want = [reference(q, k, v), *jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)]
    for g, w in zip(got, want):
        w = np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=BF16_RTOL, atol=BF16_RTOL * np.abs(w).max())
