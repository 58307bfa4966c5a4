"""Packed documents (data.packing = "documents"): segment ids and positions from the end-of-document token, attention
that never crosses a document on every path, and the loss of a row that does not depend on the order of its documents.

The must-show of issue 22: in fp32, a row holding documents [A, B] has the loss of the row [B, A] (one device, ring
context parallelism over 2, all-gather context parallelism over 2, fsdp_tp, GPipe and 1F1B pipelines), and without
their separators (one document a row: attention and positions across the whole row, as without packing) the two
differ, in the same compiled program. The packed losses are bitwise equal on every one of these layouts (observed
under the suite's XLA settings), and the test asks for that; the gradients, summed over the documents in another
order, agree to 1e-5.

Attention kernels: with segment ids, ring and all-gather attention equal the reference with the same segments, and
the reference equals attention run on each document alone. Tolerance 1e-5 absolute, as tests/test_ring_attention.py.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardkit.attention.kernel import Platform, choose_kernel
from shardkit.attention.reference import reference_attention
from shardkit.attention.ring import allgather_attention, ring_attention
from shardkit.data.packing import documents, packing_of
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.mesh import build_mesh
from shardkit.recipe import DataSection, MeshSection
from shardkit.step import build_step
from tests.helpers import recipe

EOS = 1
JOINED = 0  # a token that is not EOS: rows whose separators are replaced by it hold one document
TOL = 1e-5
HOPPER = Platform(nvidia_gpu=True, hopper=True, process_sees_gpu=True)


# ---- segments and positions ---------------------------------------------------------------------------------------
def test_end_of_document_opens_a_segment_and_restarts_positions():
    tokens = jnp.array([[5, 6, EOS, 7, 8, 9, EOS, 4], [EOS, 3, 3, 3, 3, 3, 3, 3]])
    got = documents(tokens, EOS)
    np.testing.assert_array_equal(got.segments_BS, [[0, 0, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(got.positions_BS, [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])


def test_packing_finds_its_end_of_document_id(tmp_path):
    assert packing_of(DataSection(), 256) is None
    assert packing_of(DataSection(packing="documents", eos_id=7), 256).eos_id == 7
    data = tmp_path / "train.bin"
    data.write_bytes(b"\0\0" * 8)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 100, "eos_id": 42, "dtype": "uint16"}))
    assert packing_of(DataSection(source="bin", path=str(data), packing="documents"), 256).eos_id == 42


@pytest.mark.parametrize("section, field", [
    ({"packing": "documents"}, "data.eos_id"),  # synthetic data has no meta.json
    ({"packing": "documents", "eos_id": 256}, "data.eos_id"),  # outside the vocab
    ({"packing": "rows"}, "data.packing"),
    ({"eos_id": -1}, "data.eos_id"),
])
def test_bad_packing_names_the_field(section, field):
    with pytest.raises(ShardkitError) as error:
        packing_of(DataSection(**section), 256)
    assert error.value.field == field


def test_packed_rows_choose_cudnns_packed_layout_from_cudnn_9_6_and_the_choice_says_why():
    older, packed_layout = (lambda: 90000), (lambda: 90600)
    assert choose_kernel("auto", HOPPER, jnp.bfloat16, 64, version_probe=older).kernel == "cudnn"
    choice = choose_kernel("auto", HOPPER, jnp.bfloat16, 64, packed=True, version_probe=older)
    assert choice.kernel == "xla" and "cuDNN >= 9.6.0" in choice.reason
    with pytest.raises(ShardkitError, match="9.6.0"):
        choose_kernel("cudnn", HOPPER, jnp.bfloat16, 64, packed=True, version_probe=older)
    choice = choose_kernel("cudnn", HOPPER, jnp.bfloat16, 64, packed=True, version_probe=packed_layout)
    assert choice.kernel == "cudnn" and "packed layout" in choice.reason


# ---- attention kernels with segment ids ---------------------------------------------------------------------------
def _inputs(seq: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (2, seq, 2, 2, 8))
    k = jax.random.normal(keys[1], (2, seq, 2, 8))
    v = jax.random.normal(keys[2], (2, seq, 2, 8))
    return q, k, v, jax.random.normal(keys[3], q.shape)


def _segments(seq: int, seed: int = 1):
    """Two rows of segment ids with documents of random lengths (some shorter than a ring chunk, some longer)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 5, (2, seq)), axis=1), jnp.int32)


def test_reference_with_segments_is_attention_on_each_document_alone():
    q, k, v, _ = _inputs(16)
    segments = jnp.array([[0] * 5 + [1] * 11, [0] * 9 + [3] * 7])
    out = reference_attention(q, k, v, True, segments)
    for row, cut in enumerate((5, 9)):
        for piece in (slice(0, cut), slice(cut, 16)):
            alone = reference_attention(q[row:row + 1, piece], k[row:row + 1, piece], v[row:row + 1, piece], True)
            np.testing.assert_allclose(out[row:row + 1, piece], alone, atol=TOL, rtol=0)


@pytest.mark.parametrize("variant, ring, causal, chunk", [
    (ring_attention, 2, True, 512),
    (ring_attention, 4, True, 2),
    (allgather_attention, 4, True, 2),
    (ring_attention, 4, False, 4),
    (allgather_attention, 2, False, 512),
], ids=["ring2", "ring4-chunked", "allgather4-chunked", "ring4-full", "allgather2-full"])
def test_context_parallel_attention_with_segments_equals_reference(variant, ring, causal, chunk):
    mesh = build_mesh(MeshSection(sequence=ring, data=jax.device_count() // ring))
    q, k, v, cotangent = _inputs(32)
    segments = _segments(32)

    def output_and_grads(attend):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(cotangent)

    got = jax.jit(lambda: output_and_grads(
        lambda q, k, v: variant(q, k, v, mesh, "sequence", causal, chunk, segments_BS=segments)))()
    want = jax.jit(lambda: output_and_grads(lambda q, k, v: reference_attention(q, k, v, causal, segments)))()
    np.testing.assert_allclose(got[0], want[0], atol=TOL, rtol=0)
    for name, g, w in zip("qkv", got[1], want[1]):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0, err_msg=f"d{name}")
    unsegmented = reference_attention(q, k, v, causal)
    assert np.abs(np.asarray(got[0]) - np.asarray(unsegmented)).max() > 1e-2  # the segments mattered


# ---- the loss of a row does not depend on the order of its documents ----------------------------------------------
def _document_rows(batch: int, seq_len: int, vocab: int, seed: int = 0):
    """(rows [A, B], rows [B, A]): each row the end of a previous document, then A and B, each ended by EOS."""
    rng = np.random.default_rng(seed)
    ab, ba = [], []
    for _ in range(batch):
        n = int(rng.integers(4, seq_len - 5))
        body = rng.integers(2, vocab, seq_len - 2)  # no EOS inside a document
        a, b = list(body[:n]), list(body[n:])
        ab.append([EOS] + a + [EOS] + b + [EOS])
        ba.append([EOS] + b + [EOS] + a + [EOS])
    return jnp.asarray(ab, jnp.int32), jnp.asarray(ba, jnp.int32)


LAYOUTS = {
    "single": ("single", ),
    "ring-cp2": ("cp", "mesh.sequence=2", "train.context=ring"),
    "allgather-cp2": ("cp", "mesh.sequence=2", "train.context=allgather"),
    "fsdp_tp": ("fsdp_tp", ),
    # Two stages (pipeline 2 x data 4), as many micro-batches as stages: the segment ids travel with each micro-batch
    # through a stage boundary, and 1F1B still has its warm-up, steady state and drain, at the fewest ticks to compile
    # (each doubling of the stages doubles a pipeline's compile).
    "pipeline-gpipe": ("pp", "mesh.pipeline=2", "pipeline.microbatches=2"),
    "pipeline-1f1b": ("pp", "mesh.pipeline=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"),
}


@functools.cache  # test_packed_loss_is_the_same_on_every_layout reads three layouts its neighbours already ran
def _losses(name: str):
    """Loss and gradients under one packed layout, fp32, on the recipe's batch shape, of rows [A, B], [B, A], and the
    same two with their end-of-document tokens replaced by another token (one document a row, as without packing):
    one compiled program for all four."""
    overrides = (*LAYOUTS[name][1:], "precision.policy=float32", "data.packing=documents", f"data.eos_id={EOS}")
    devices = jax.devices()[:1] if name == "single" else None
    builder = build_step(build_layout(recipe(LAYOUTS[name][0], *overrides), devices))
    train = builder.recipe.train
    params = builder.init_state(0)["params"]
    gradients = jax.jit(builder.gradients, in_shardings=(builder.state_shardings()["params"], builder.batch_sharding()))
    vocab = builder.layout.config.vocab
    ab, ba = _document_rows(train.global_batch, train.seq_len, vocab)
    return [gradients(params, rows) for rows in (ab, ba, *(jnp.where(r == EOS, JOINED, r) for r in (ab, ba)))]


def _assert_order_free(name: str):
    (loss_ab, grads_ab), (loss_ba, grads_ba), (joined_ab, _), (joined_ba, _) = _losses(name)
    # Every token's loss is the same in both orders; their sum is not bitwise so: swapping the documents moves each
    # token's loss to another position, and XLA's reduction tree (its vector width, the split of the sum over the
    # devices holding the batch and sequence) adds them in another order. fsdp_tp on XLA:CPU: 1 ulp apart. Attention
    # or rotary positions crossing a document move the loss by more than 1e-3 (the joined check below).
    ulps = abs(float(loss_ab) - float(loss_ba)) / float(np.spacing(np.float32(loss_ab)))
    assert ulps <= 2, (
        f"loss of [A, B] {float(loss_ab)!r} and of [B, A] {float(loss_ba)!r} are {ulps:.0f} fp32 ulps apart: equal in "
        "exact arithmetic, so more than a summation order's 2 ulps means attention or rotary positions cross a "
        "document")
    for g_ab, g_ba in zip(jax.tree.leaves(grads_ab), jax.tree.leaves(grads_ba)):
        np.testing.assert_allclose(g_ab, g_ba, atol=1e-5, rtol=0)
    # The same program on the rows without their separators: attention and positions run across the whole row, and
    # the two orders differ, so the rows can tell a layout whose attention crosses documents.
    assert abs(float(joined_ab) - float(joined_ba)) > 1e-3, (float(joined_ab), float(joined_ba))


def test_order_of_documents_does_not_change_the_loss_on_one_device():
    _assert_order_free("single")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ring-cp2", "allgather-cp2", "fsdp_tp", "pipeline-gpipe", "pipeline-1f1b"])
def test_order_of_documents_does_not_change_the_loss(name):
    _assert_order_free(name)


@pytest.mark.slow
def test_packed_loss_is_the_same_on_every_layout():
    """The packed loss of one layout is the single device's, to the layouts' own tolerance."""
    single = float(_losses("single")[0][0])
    for name in ("ring-cp2", "pipeline-gpipe"):
        assert abs(float(_losses(name)[0][0]) - single) < 1e-5, name
