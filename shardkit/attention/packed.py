"""Packed documents on cuDNN's packed ("ragged") layout: one fused attention call over rows of several documents.

cuDNN attends each document of a row as its own sequence when told where each one starts and how long it is: per row,
the start (offset) and the length of each document, padded with -1 to a fixed count of documents M
(`max_documents`). JAX reaches that layout only through its private cuDNN primitives (`shardkit.attention.kernel`
holds the one import and the table of what it needs: cuDNN >= 9.6, Hopper or later); `packed_forward` and
`packed_backward` bind them (`cudnn_ragged` says why the unwrapped ones), the forward returning the output and cuDNN's
fp32 softmax statistics, laid out (B * M, heads, S): one row per document slot, which the backward takes back as
they are.

The offsets and lengths are a pure function of the segment ids (`document_slots`), computed on the device where the
attention runs. M is static; a row holding more documents than M cannot be described, and a call whose rows include
one runs XLA's chunked kernel (shardkit.attention.blocks, exact, at most `FALLBACK_CHUNK` keys scored at once)
instead, chosen on the device (`jax.lax.cond`): every row stays exact, and only calls with a row of many short
documents pay the slower kernel.

Where it runs (`shardkit.attention.plain.attend`): for whole rows (`packed_region_attention`), the slots, the
choice of kernel and the fallback run where attention is called, and cuDNN's primitives alone in a region manual over
every mesh axis not manual yet, with the custom VJP outside it, as `shardkit.attention.blocks.region_fused_attention`
runs unpacked rows inside a pipeline stage and for the same reasons; so plain layouts and every pipeline schedule
share it. All-gather context parallelism (`gathered_packed_attention`) gathers K/V and the segment ids, places the
device's queries at their positions of the whole sequence and describes, per document the device's queries touch, the
document's keys from its start to the device's last query in it: cuDNN's causal mask is aligned at the top left of
each (query, key) slot, so a slot must start its queries and keys at the same position. The queries before the
device's own in that slot are zeros whose output is discarded and whose gradient is zero: the price of that
alignment, at most the earlier part of the one document that crosses into the device's block, and up to the whole
sequence before the block when one document spans it. Ring context parallelism cannot put a block whose queries
continue a document from an earlier block into such slots, and keeps the XLA block kernel (the kernel choice says so).

Dimension letters: B batch, S queries, T keys, K kv heads, G query heads per kv head, E head_dim, N heads (K * G),
M document slots.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from shardkit.attention.blocks import REGION_NAMES, block_backward, block_forward, check_cudnn_inputs, cudnn_options
from shardkit.attention.kernel import cudnn_module

# One document slot per this many tokens, plus two for the partial documents at a row's ends: rows whose documents
# average at least this length always fit. Each slot costs cuDNN's statistics one fp32 value per query and head (the
# residual the backward reads), 4 * M bytes against the queries' 2 * E: at S = 4096 (M = 18) and head_dim 64 about
# half the queries' size. Rows of shorter documents take the exact fallback.
TOKENS_PER_SLOT = 256
FALLBACK_CHUNK = 256  # XLA's fallback scores (B, N, S, chunk) in fp32 at once: a quarter of its default chunk's


def max_documents(seq_len: int) -> int:
    """M, the document slots of a row of `seq_len` tokens (at least 2: JAX reads one slot as no packing)."""
    return seq_len // TOKENS_PER_SLOT + 2


class Slots(NamedTuple):
    """cuDNN's packed description of rows: lengths (B, M) and offsets (B, M + 1), -1 past the row's documents.

    JAX's private call reads the slot count as the offsets' columns minus one (its docstring: [B, M + 1]), so the
    offsets carry one more column than the lengths, always -1: no terminating entry. `fits` (B,): whether the row's
    documents fit in M slots; `covered` (B, S): whether a position lies in a slot (cuDNN writes only those).
    """

    lengths_BM: jax.Array
    offsets_BM1: jax.Array
    fits_B: jax.Array
    covered_BS: jax.Array


def document_slots(segments_BS: jax.Array, slots: int, lo=0, hi=None) -> Slots:
    """The slots of the documents that touch positions [lo, hi) of each row: from each document's start to its end or
    `hi`, whichever is first. `segments_BS`: each position's segment id, constant along a document and changing at
    each document's start (shardkit/data/packing.py); `lo`, `hi` may be traced (all-gather context parallelism).

    Whole rows (lo = 0, hi = S) give one slot per document, covering every position."""
    length = segments_BS.shape[1]
    hi = length if hi is None else hi
    index_S = jnp.arange(length, dtype=jnp.int32)
    starts_BS = jnp.concatenate([jnp.ones_like(segments_BS[:, :1], bool),
                                 segments_BS[:, 1:] != segments_BS[:, :-1]], axis=1)
    document_BS = jnp.cumsum(starts_BS, axis=1, dtype=jnp.int32) - 1  # 0-based document of each position
    first_B = jax.lax.dynamic_index_in_dim(document_BS, lo, axis=1, keepdims=False)
    count_B = jax.lax.dynamic_index_in_dim(document_BS, hi - 1, axis=1, keepdims=False) - first_B + 1
    wanted_BM = first_B[:, None] + jnp.arange(slots + 1, dtype=jnp.int32)[None, :]
    hits_BMS = starts_BS[:, None, :] & (document_BS[:, None, :] == wanted_BM[..., None])
    begin_BM = jnp.where(hits_BMS.any(-1), jnp.argmax(hits_BMS, axis=-1).astype(jnp.int32), hi)
    slot_M = jnp.arange(slots, dtype=jnp.int32)
    used_BM = slot_M[None, :] < count_B[:, None]
    end_BM = jnp.minimum(begin_BM[:, 1:], hi)
    lengths_BM = jnp.where(used_BM, end_BM - begin_BM[:, :-1], -1)
    offsets_BM = jnp.where(used_BM, begin_BM[:, :-1], -1)
    offsets_BM1 = jnp.concatenate([offsets_BM, jnp.full_like(offsets_BM[:, :1], -1)], axis=1)
    first_start_B = jnp.where(used_BM[:, 0], offsets_BM[:, 0], hi)
    covered_BS = (index_S[None, :] >= first_start_B[:, None]) & (index_S[None, :] < hi)
    return Slots(lengths_BM, offsets_BM1, count_B <= slots, covered_BS)


# ---- cuDNN's packed call: the private primitives, bound in this one place ----------------------------------------
class Ragged(NamedTuple):
    """The slots as cuDNN's packed kernel reads them (`cudnn_ragged`)."""

    lengths_BM: jax.Array
    q_offsets_BM1: jax.Array
    kv_offsets_BM1: jax.Array


def cudnn_ragged(lengths_BM, offsets_BM1, q_row: int, kv_row: int, q_token: int, kv_token: int,
                 shard_rows: int | None = None) -> Ragged:
    """The slots as cuDNN's packed kernel reads them, for the devices that each hold `shard_rows` rows (all: one).

    cuDNN sees a device's b rows as b * M sequences, slot m of row r being sequence r * M + m, each with its length
    and, in the device's flattened offsets, its start in elements of the device's tensor (b * M + 1 entries read; the
    last is the end). Unused slots get length 0 at their row's end. Queries and keys have their own elements per
    token (`q_token`, `kv_token`, the device's heads x head_dim): JAX 0.10.2's own conversion (`_fix_seqlen_offsets`,
    applied by the primitives' wrappers) scales both by the queries' heads, which misplaces the keys of grouped-query
    attention, so the unwrapped primitives are bound with these instead. `q_row`, `kv_row`: the rows' lengths."""
    batch, slots = lengths_BM.shape
    rows = batch if shard_rows is None else shard_rows
    used_BM = lengths_BM >= 0
    local_B1 = (jnp.arange(batch, dtype=jnp.int32) % rows)[:, None]

    def offsets(row: int, token: int):
        start_BM = jnp.where(used_BM, offsets_BM1[:, :slots] + local_B1 * row, (local_B1 + 1) * row)
        shards = batch // rows
        end_Hr = jnp.full((shards, rows), rows * row, jnp.int32)  # each device's entry b * M, then padding
        flat_H = jnp.concatenate([start_BM.reshape(shards, rows * slots), end_Hr], axis=1)
        return (flat_H * token).reshape(batch, slots + 1)

    return Ragged(jnp.where(used_BM, lengths_BM, 0), offsets(q_row, q_token), offsets(kv_row, kv_token))


def _packed_operands(dtype, ragged: Ragged) -> list[jax.Array]:
    """bias (absent), q/kv lengths, q/kv offsets, k/v page tables (absent)."""
    none = jnp.zeros(0, dtype)
    return [none, ragged.lengths_BM, ragged.lengths_BM, ragged.q_offsets_BM1, ragged.kv_offsets_BM1, none, none]


def packed_forward(q_BSKGE, k_BTKE, v_BTKE, ragged: Ragged, causal: bool = True):
    """(out_BSKGE, stats): cuDNN's packed attention and its fp32 statistics (B * M, N, S), on local arrays (a region
    manual over every mesh axis). Positions outside every slot are left as cuDNN leaves them."""
    batch, length, kv_heads, groups, head_dim = q_BSKGE.shape
    check_cudnn_inputs(q_BSKGE.dtype, head_dim)
    q_BSNE = q_BSKGE.reshape(batch, length, kv_heads * groups, head_dim)  # head n = k * G + g: cuDNN's GQA grouping
    out_BSNE, stats = cudnn_module()._dot_product_attention_fwd_p.bind(
        q_BSNE, k_BTKE, v_BTKE, *_packed_operands(q_BSKGE.dtype, ragged), is_training=True,
        **cudnn_options(head_dim, causal))
    return out_BSNE.reshape(q_BSKGE.shape), stats


def packed_backward(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, stats, dout_BSKGE, ragged: Ragged, causal: bool = True):
    """(dq, dk, dv) in the inputs' dtype from the forward's output and statistics; positions outside every slot are
    left as cuDNN leaves them (`Slots.covered_BS` says which to zero)."""
    batch, length, kv_heads, groups, head_dim = q_BSKGE.shape
    as_heads = lambda x: x.astype(q_BSKGE.dtype).reshape(batch, length, kv_heads * groups, head_dim)
    dq_BSNE, dk_BTKE, dv_BTKE = cudnn_module()._dot_product_attention_bwd_p.bind(
        as_heads(q_BSKGE), k_BTKE, v_BTKE, *_packed_operands(q_BSKGE.dtype, ragged), stats,
        as_heads(out_BSKGE), as_heads(dout_BSKGE), **cudnn_options(head_dim, causal))
    return dq_BSNE.reshape(q_BSKGE.shape), dk_BTKE, dv_BTKE


def _covered(grads, covered_BS):
    """The gradients zeroed outside every slot (where cuDNN writes nothing)."""
    keep = lambda x: jnp.where(covered_BS.reshape(*covered_BS.shape, *[1] * (x.ndim - 2)), x, 0)
    return tuple(keep(g) for g in grads)


# ---- one attention call: cuDNN where the slots describe every row, else XLA's chunked kernel -----------------------
@dataclasses.dataclass(frozen=True)
class PackedCall:
    """How one packed call runs: `cudnn` (with the fallback) or `xla` (the fallback alone, what CPU tests run), the
    causal mask, M, and the region cuDNN's primitives run in (None: already manual over every mesh axis)."""

    implementation: str
    causal: bool
    slots: int
    region: PackedRegion | None = None

    def ragged(self, q_BSKGE, k_BTKE, slots: Slots) -> Ragged:
        """The slots as cuDNN reads them on each device of the region (or on this one, without a region): computed
        here, outside the region, and made to depend on the queries (`_unknown`), so the region computes nothing of
        its own."""
        batch, length, kv_heads, groups, head_dim = q_BSKGE.shape
        region = self.region
        degree = lambda axes: math.prod(region.mesh.shape[a] for a in axes or ()) if region else 1
        rows, heads = batch // degree(region and region.batch), kv_heads // degree(region and region.heads)
        ragged = cudnn_ragged(slots.lengths_BM, slots.offsets_BM1, length, k_BTKE.shape[1],
                              heads * groups * head_dim, heads * head_dim, rows)
        return ragged if self.region is None else _unknown(ragged, q_BSKGE)

    def forward(self, q_BSKGE, k_BTKE, v_BTKE, slots: Slots):
        kernel = functools.partial(packed_forward, causal=self.causal)
        ragged = self.ragged(q_BSKGE, k_BTKE, slots)
        if self.region is None:
            return kernel(q_BSKGE, k_BTKE, v_BTKE, ragged)
        q_spec, kv_spec, slots_spec, stats_spec = self.region.specs()
        in_specs = (q_spec, kv_spec, kv_spec, Ragged(*[slots_spec] * 3))
        return self.region.region(kernel, in_specs, (q_spec, stats_spec))(q_BSKGE, k_BTKE, v_BTKE, ragged)

    def backward(self, q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, stats, dout_BSKGE, slots: Slots):
        kernel = functools.partial(packed_backward, causal=self.causal)
        args = (q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, stats, dout_BSKGE, self.ragged(q_BSKGE, k_BTKE, slots))
        if self.region is None:
            return kernel(*args)
        q_spec, kv_spec, slots_spec, stats_spec = self.region.specs()
        in_specs = (q_spec, kv_spec, kv_spec, q_spec, stats_spec, q_spec, Ragged(*[slots_spec] * 3))
        return self.region.region(kernel, in_specs, (q_spec, kv_spec, kv_spec))(*args)


def _unknown(ints, q_BSKGE):
    """Integer inputs of a nested region made to depend on the queries (adding a zero computed from one of them).

    Why: under remat, a nested region's inputs that do not depend on the differentiated values (the slots, from the
    integer segment ids) are handed back out of the region as residuals, and JAX 0.10.2 sizes those by every mesh
    axis, the enclosing manual ones too ("'sdy.manual_computation' op result shape ... must match"), as
    `shardkit.attention.blocks.region_fused_attention`'s note says of differentiating through such a region."""
    first = q_BSKGE.reshape(-1)[0]
    zero = jnp.minimum(jnp.isnan(first).astype(jnp.int32), 0)
    return jax.tree.map(lambda x: x + zero, ints)


def _xla_forward(q_BSKGE, k_BTKE, v_BTKE, segments_BS, call: PackedCall):
    """XLA's chunked kernel; its log-sum-exp stored in slot 0 of each row of the statistics' layout."""
    out_BSKGE, lse_BKGS = block_forward(q_BSKGE, k_BTKE, v_BTKE, call.causal, "xla", FALLBACK_CHUNK,
                                        (segments_BS, segments_BS))
    batch, length, kv_heads, groups, _ = q_BSKGE.shape
    stats_BMNS = jnp.zeros((batch, call.slots, kv_heads * groups, length), jnp.float32)
    stats_BMNS = stats_BMNS.at[:, 0].set(lse_BKGS.reshape(batch, kv_heads * groups, length))
    return out_BSKGE.astype(q_BSKGE.dtype), stats_BMNS.reshape(batch * call.slots, kv_heads * groups, length)


def _xla_backward(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, stats, dout_BSKGE, segments_BS, call: PackedCall):
    batch, length, kv_heads, groups, _ = q_BSKGE.shape
    lse_BKGS = stats.reshape(batch, call.slots, kv_heads, groups, length)[:, 0]
    grads = block_backward(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, dout_BSKGE, call.causal, "xla",
                           FALLBACK_CHUNK, (segments_BS, segments_BS))
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q_BSKGE, k_BTKE, v_BTKE)))


def attend_packed(q_BSKGE, k_BTKE, v_BTKE, segments_BS, slots: Slots, call: PackedCall):
    """(out, stats): cuDNN when every row fits its slots, else the fallback (decided on the device)."""
    if call.implementation == "xla":
        return _xla_forward(q_BSKGE, k_BTKE, v_BTKE, segments_BS, call)
    cudnn = lambda: call.forward(q_BSKGE, k_BTKE, v_BTKE, slots)
    xla = lambda: _xla_forward(q_BSKGE, k_BTKE, v_BTKE, segments_BS, call)
    return jax.lax.cond(slots.fits_B.all(), cudnn, xla)


def attend_packed_grads(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, stats, dout_BSKGE, segments_BS, slots: Slots,
                        call: PackedCall):
    """(dq, dk, dv) in the inputs' dtypes, on the kernel `attend_packed` ran for these rows."""
    args = (q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, stats, dout_BSKGE)
    if call.implementation == "xla":
        return _xla_backward(*args, segments_BS, call)
    cudnn = lambda: _covered(call.backward(*args, slots), slots.covered_BS)
    xla = lambda: _xla_backward(*args, segments_BS, call)
    return jax.lax.cond(slots.fits_B.all(), cudnn, xla)


# ---- whole rows: cuDNN's primitives in a region manual over every remaining mesh axis ------------------------------
@dataclasses.dataclass(frozen=True)
class PackedRegion:
    """The nested region's mesh, manual axes, and the batch and kv-head entries of its specs."""

    mesh: object
    manual: frozenset
    batch: tuple | None
    heads: tuple | None

    def specs(self):
        """(queries B S K G E, keys B T K E, slots B M, statistics B*M N S)."""
        batch, heads = self.batch, self.heads
        return (PartitionSpec(batch, None, heads, None, None), PartitionSpec(batch, None, heads, None),
                PartitionSpec(batch, None), PartitionSpec(batch, heads, None))

    def region(self, body, in_specs, out_specs):
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(self.manual))


def packed_region_attention(q_BSKGE, k_BTKE, v_BTKE, segments_BS, causal: bool = True,
                            kv_spec: PartitionSpec | None = None, mesh=None, implementation: str = "cudnn"):
    """Attention of packed rows on cuDNN's packed layout, from anywhere: cuDNN's primitives run in a region manual over
    every axis of the enclosing abstract mesh (or `mesh`, outside any region) not manual yet, laid out by `kv_spec`
    (the keys' activation spec, B T K E) as `shardkit.attention.blocks.region_fused_attention` lays out its region;
    the slots, the choice of kernel and the fallback run outside it. Output in the inputs' dtype."""
    if implementation == "cudnn":
        check_cudnn_inputs(q_BSKGE.dtype, q_BSKGE.shape[-1])
    abstract = jax.sharding.get_abstract_mesh()
    region_mesh = mesh if abstract.empty and mesh is not None else abstract
    manual = frozenset(region_mesh.axis_names) - frozenset(getattr(region_mesh, "manual_axes", ()))
    entries = list(kv_spec or ()) + [None] * (4 - len(kv_spec or ()))
    keep = lambda entry: tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in manual) or None
    region = PackedRegion(region_mesh, manual, keep(entries[0]), keep(entries[2]))
    call = PackedCall(implementation, causal, max_documents(q_BSKGE.shape[1]), region)
    return _region_attention(q_BSKGE, k_BTKE, v_BTKE, segments_BS, call)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _region_attention(q_BSKGE, k_BTKE, v_BTKE, segments_BS, call: PackedCall):
    return _region_forward(q_BSKGE, k_BTKE, v_BTKE, segments_BS, call)[0]


def _region_forward(q_BSKGE, k_BTKE, v_BTKE, segments_BS, call: PackedCall):
    slots = document_slots(segments_BS, call.slots)
    outputs = attend_packed(q_BSKGE, k_BTKE, v_BTKE, segments_BS, slots, call)
    out_BSKGE, stats = (checkpoint_name(x, name) for x, name in zip(outputs, REGION_NAMES))
    return out_BSKGE, (q_BSKGE, k_BTKE, v_BTKE, segments_BS, out_BSKGE, stats)


def _region_backward(call: PackedCall, residuals, dout_BSKGE):
    q_BSKGE, k_BTKE, v_BTKE, segments_BS, out_BSKGE, stats = residuals
    slots = document_slots(segments_BS, call.slots)
    grads = attend_packed_grads(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, stats, dout_BSKGE, segments_BS, slots, call)
    return (*grads, None)


_region_attention.defvjp(_region_forward, _region_backward)


# ---- all-gather context parallelism (inside its region, manual over every mesh axis) ------------------------------
def gathered_packed_attention(q_BSKGE, k_BTKE, v_BTKE, segments_BS, axis: str, implementation: str = "cudnn",
                              causal: bool = True):
    """This device's block of queries (contiguous, in sequence order) against the K/V of the whole sequence,
    gathered over `axis`, on the packed layout (see the module docstring). Local arrays; output in q's dtype."""
    # The slots describe the documents that touch this device's block: M by the block's length, not the sequence's.
    call = PackedCall(implementation, causal, max_documents(q_BSKGE.shape[1]))
    return _gathered(q_BSKGE, k_BTKE, v_BTKE, segments_BS, axis, call)


class _Whole(NamedTuple):
    """The whole sequence as the packed call sees it: this device's queries placed at their positions, the gathered
    keys, values and segment ids, the slots, and where the device's block starts."""

    q_BSKGE: jax.Array
    k_BTKE: jax.Array
    v_BTKE: jax.Array
    segments_BS: jax.Array
    slots: Slots
    start: jax.Array


def _place(x_BS, start, length: int):
    """`x_BS` (this device's block) at `start` of zeros as long as the whole sequence."""
    whole = jnp.zeros((x_BS.shape[0], length, *x_BS.shape[2:]), x_BS.dtype)
    return jax.lax.dynamic_update_slice_in_dim(whole, x_BS, start, axis=1)


def _whole(q_BSKGE, k_BTKE, v_BTKE, segments_BS, axis: str, call: PackedCall) -> _Whole:
    gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
    k_all, v_all, segments_all = gather(k_BTKE), gather(v_BTKE), gather(segments_BS)
    block = q_BSKGE.shape[1]
    start = jax.lax.axis_index(axis) * block
    slots = document_slots(segments_all, call.slots, start, start + block)
    return _Whole(_place(q_BSKGE, start, k_all.shape[1]), k_all, v_all, segments_all, slots, start)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _gathered(q_BSKGE, k_BTKE, v_BTKE, segments_BS, axis: str, call: PackedCall):
    return _gathered_forward(q_BSKGE, k_BTKE, v_BTKE, segments_BS, axis, call)[0]


def _gathered_forward(q_BSKGE, k_BTKE, v_BTKE, segments_BS, axis, call):
    whole = _whole(q_BSKGE, k_BTKE, v_BTKE, segments_BS, axis, call)
    out_all, stats = attend_packed(whole.q_BSKGE, whole.k_BTKE, whole.v_BTKE, whole.segments_BS, whole.slots, call)
    out_BSKGE = jax.lax.dynamic_slice_in_dim(out_all, whole.start, q_BSKGE.shape[1], axis=1)
    return out_BSKGE, (q_BSKGE, k_BTKE, v_BTKE, segments_BS, out_BSKGE, stats)


def _gathered_backward(axis, call, residuals, dout_BSKGE):
    q_BSKGE, k_BTKE, v_BTKE, segments_BS, out_BSKGE, stats = residuals
    whole = _whole(q_BSKGE, k_BTKE, v_BTKE, segments_BS, axis, call)
    length = whole.k_BTKE.shape[1]
    # The placed queries' output and cotangent: zeros elsewhere, so the queries before this device's add nothing.
    out_all, dout_all = (_place(x, whole.start, length) for x in (out_BSKGE, dout_BSKGE))
    dq_all, dk_all, dv_all = attend_packed_grads(whole.q_BSKGE, whole.k_BTKE, whole.v_BTKE, out_all, stats, dout_all,
                                                 whole.segments_BS, whole.slots, call)
    dq = jax.lax.dynamic_slice_in_dim(dq_all, whole.start, q_BSKGE.shape[1], axis=1)
    # The gather's transpose in fp32, so the devices' partial gradients of a key sum at full precision.
    scatter = lambda g, x: jax.lax.psum_scatter(g.astype(jnp.float32), axis, scatter_dimension=1,
                                                tiled=True).astype(x.dtype)
    return dq.astype(q_BSKGE.dtype), scatter(dk_all, k_BTKE), scatter(dv_all, v_BTKE), None


_gathered.defvjp(_gathered_forward, _gathered_backward)
