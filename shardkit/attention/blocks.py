"""Attention of one query block against one key/value block, returning the softmax log-sum-exp in fp32.

Context parallelism (shardkit.attention.ring) is built of such block calls and merges their partial results exactly:
with `out_i` the block's normalised output and `lse_i` its log-sum-exp of the scaled scores (natural log, fp32),

    lse = logsumexp_i lse_i,        out = sum_i exp(lse_i - lse) * out_i.

The backward needs no per-block state: given the *global* output and log-sum-exp, each block's probabilities are
exp(scores - lse) and, with D = rowsum(dout * out), its gradients follow from (q, k_i, v_i, out, lse, dout) alone (the
FlashAttention-2 backward identity), which is what a fused kernel's backward takes.

Two kernels with that contract (`implementation`):
    xla    chunked online softmax in XLA einsums; at most `chunk` keys scored at once (any device, fp32 or bf16).
    cudnn  cuDNN's fused flash attention through JAX's private `jax._src.cudnn.fused_attention_stablehlo` primitives
           (NVIDIA GPUs, bf16/fp16, head_dim a multiple of 8 up to 256). The public `jax.nn.dot_product_attention`
           is not used: it returns the log-sum-exp in the output dtype and its VJP drops the log-sum-exp's gradient.
           The primitives are bound directly (no custom partitioning), so call them on local arrays: inside a
           shard_map that is manual over every mesh axis.

`region_fused_attention` runs one whole-sequence block from inside an enclosing manual region (a pipeline stage), in
a nested region manual over the remaining axes, with the custom VJP outside it (see the note above it).

`causal` masks by position inside the block (query i sees keys j <= i): the diagonal block of a (zigzag) layout whose
positions increase along the block. Every other block a context-parallel layout visits is unmasked.

`segments` (packed documents, shardkit/data/packing.py), the queries' and the keys' segment ids (q_segments_BS,
k_segments_BT), masks every pair from different segments as well (XLA kernel only: packed rows on cuDNN run its
packed layout, shardkit/attention/packed.py). A query whose every key in the block is masked (the block holds
another document) gets output 0 and log-sum-exp NEG_INF, which the merge weighs to nothing.

Dimension letters: B batch, S queries, T keys, K kv heads, G query heads per kv head, E head_dim, C key chunk,
N chunks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from shardkit.attention.kernel import KERNELS, Platform, cudnn_module, cudnn_rejects

NEG_INF = float(jnp.finfo(jnp.float32).min)  # finite, so a fully masked chunk never makes inf - inf
DEFAULT_CHUNK = 512
IMPLEMENTATIONS = KERNELS


def block_forward(q_BSKGE, k_BTKE, v_BTKE, causal: bool, implementation: str, chunk: int = DEFAULT_CHUNK,
                  segments=None):
    """(out_BSKGE, lse_BKGS): one block's normalised attention output and fp32 log-sum-exp of its scaled scores.

    The output is fp32 from the XLA kernel, the input dtype from cuDNN; merge it in fp32 (`merge_pair`).
    `segments`: None, or (q_segments_BS, k_segments_BT) to mask pairs from different documents.
    """
    if implementation == "cudnn":
        _check_no_segments(segments)
        return _cudnn_forward(q_BSKGE, k_BTKE, v_BTKE, causal)
    return _xla_forward(q_BSKGE, k_BTKE, v_BTKE, causal, chunk, segments)


def block_backward(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, dout_BSKGE, causal: bool, implementation: str,
                   chunk: int = DEFAULT_CHUNK, segments=None):
    """(dq, dk, dv) in fp32 of this block's share of the loss, from the global `out` and `lse` of these queries."""
    if implementation == "cudnn":
        _check_no_segments(segments)
        return _cudnn_backward(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, dout_BSKGE, causal)
    return _xla_backward(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, dout_BSKGE, causal, chunk, segments)


def _check_no_segments(segments) -> None:
    if segments is not None:
        raise ValueError("the cuDNN block kernel takes no segment ids; packed documents run "
                         "shardkit.attention.packed or the XLA block kernel")


def merge_pair(out_BSKGE, lse_BKGS, block_out_BSKGE, block_lse_BKGS):
    """Fold one block's (out, lse) into the running (out, lse), exactly; the result is fp32."""
    lse_new = jnp.logaddexp(lse_BKGS, block_lse_BKGS)
    weight = lambda lse: jnp.einsum("bkgs->bskg", jnp.exp(lse - lse_new))[..., None]
    out = (out_BSKGE.astype(jnp.float32) * weight(lse_BKGS)
           + block_out_BSKGE.astype(jnp.float32) * weight(block_lse_BKGS))
    return out, lse_new


def merge_blocks(out_NBSKGE, lse_NBKGS):
    """The merge of N blocks' results at once: lse = logsumexp_i lse_i, out = sum_i exp(lse_i - lse) out_i."""
    lse_BKGS = jax.nn.logsumexp(lse_NBKGS, axis=0)
    weights_NBSKG = jnp.einsum("nbkgs->nbskg", jnp.exp(lse_NBKGS - lse_BKGS[None]))
    return (weights_NBSKG[..., None] * out_NBSKGE.astype(jnp.float32)).sum(axis=0), lse_BKGS


def check_cudnn_inputs(dtype, head_dim: int) -> None:
    """A ValueError unless cuDNN's flash attention takes this dtype and head_dim (the primitives are bound directly,
    without JAX's process-backend check, so the device's own limit applies: Hopper's here)."""
    reason = cudnn_rejects(Platform(nvidia_gpu=True, hopper=True, process_sees_gpu=True), dtype, head_dim)
    if reason is not None:
        raise ValueError(f"cuDNN fused attention cannot run: {reason}")


# ---- XLA kernel ------------------------------------------------------------------------------------------------------
def _local_positions(length: int, anchor: jax.Array) -> jax.Array:
    """0..length-1, made to depend on `anchor` (the block's queries) through an optimization barrier.

    Why: a causal mask built from constants alone is loop-invariant inside a scan over layers, and JAX's scan
    linearization hoists such values out of the loop as residuals, so the masks (and the fill values broadcast to
    their shape) of every key chunk would be materialised once for the whole step. Tied to the queries, each mask
    lives only while its (queries x chunk) block is scored.
    """
    positions, _ = jax.lax.optimization_barrier((jnp.arange(length), anchor))
    return positions


def _scores(q_BSKGE, qpos_S, k_CKE, kpos_C, causal: bool, qseg_BS=None, kseg_BC=None):
    """Scaled scores (B, K, G, S, C) in fp32 and the mask of the pairs that count (None when all do): by position
    when causal, by segment when segment ids are given."""
    scale = q_BSKGE.shape[-1] ** -0.5
    scores = jnp.einsum("bskge,bcke->bkgsc", q_BSKGE, k_CKE, preferred_element_type=jnp.float32) * scale
    mask = (qpos_S[:, None] >= kpos_C[None, :])[None, None, None] if causal else None
    if qseg_BS is not None:
        same_B11SC = (qseg_BS[:, :, None] == kseg_BC[:, None, :])[:, None, None]
        mask = same_B11SC if mask is None else mask & same_B11SC
    if mask is None:
        return scores, None
    return jnp.where(mask, scores, NEG_INF), mask


def _chunked(x_BT: jax.Array, pos_T: jax.Array, chunk: int):
    """Split keys (dimension 1) into N chunks of at most `chunk`: (N, B, C, ...) and positions (N, C)."""
    length = x_BT.shape[1]
    size = max(d for d in range(1, min(chunk, length) + 1) if length % d == 0)
    count = length // size
    x_NBC = jnp.moveaxis(x_BT.reshape(x_BT.shape[0], count, size, *x_BT.shape[2:]), 1, 0)
    return x_NBC, pos_T.reshape(count, size)


def _chunked_segments(segments, kpos_NC, chunk: int):
    """(q_segments_BS, k segments chunked like the keys (N, B, C)), or (None, None) without segments."""
    if segments is None:
        return None, None
    q_segments_BS, k_segments_BT = segments
    return q_segments_BS, _chunked(k_segments_BT, kpos_NC.reshape(-1), chunk)[0]


def _xla_forward(q_BSKGE, k_BTKE, v_BTKE, causal: bool, chunk: int, segments=None):
    """Online softmax over key chunks: running max m, running sum l, unnormalised output o."""
    qpos_S = _local_positions(q_BSKGE.shape[1], q_BSKGE)
    k_NBCKE, kpos_NC = _chunked(k_BTKE, _local_positions(k_BTKE.shape[1], q_BSKGE), chunk)
    v_NBCKE, _ = _chunked(v_BTKE, kpos_NC.reshape(-1), chunk)
    qseg_BS, kseg_NBC = _chunked_segments(segments, kpos_NC, chunk)

    def step(acc, chunk_xs):
        o_BSKGE, m_BKGS, l_BKGS = acc
        k_CKE, v_CKE, kpos_C, kseg_BC = chunk_xs
        scores, mask = _scores(q_BSKGE, qpos_S, k_CKE, kpos_C, causal, qseg_BS, kseg_BC)
        m_new = jnp.maximum(m_BKGS, scores.max(axis=-1))
        probs = jnp.exp(scores - m_new[..., None])
        if mask is not None:
            probs = jnp.where(mask, probs, 0.0)  # a fully masked row adds nothing, whatever its running max
        correction_BKGS = jnp.exp(m_BKGS - m_new)
        l_new = l_BKGS * correction_BKGS + probs.sum(axis=-1)
        pv = jnp.einsum("bkgsc,bcke->bskge", probs.astype(v_CKE.dtype), v_CKE, preferred_element_type=jnp.float32)
        o_new = o_BSKGE * jnp.einsum("bkgs->bskg", correction_BKGS)[..., None] + pv
        return (o_new, m_new, l_new), None

    batch, length, kv_heads, groups, _ = q_BSKGE.shape
    stats_shape = (batch, kv_heads, groups, length)
    acc = (jnp.zeros(q_BSKGE.shape, jnp.float32), jnp.full(stats_shape, NEG_INF), jnp.zeros(stats_shape, jnp.float32))
    acc = _like_varying(acc, q_BSKGE)
    (o_BSKGE, m_BKGS, l_BKGS), _ = jax.lax.scan(step, acc, (k_NBCKE, v_NBCKE, kpos_NC, kseg_NBC))
    empty_BKGS = l_BKGS == 0  # every key masked for this query: the block holds another document only
    l_BKGS = jnp.where(empty_BKGS, 1.0, l_BKGS)
    lse_BKGS = jnp.where(empty_BKGS, NEG_INF, m_BKGS + jnp.log(l_BKGS))
    return o_BSKGE / jnp.einsum("bkgs->bskg", l_BKGS)[..., None], lse_BKGS


def _like_varying(tree, reference: jax.Array):
    """Mark freshly made accumulators as varying over the manual axes `reference` varies over (shard_map's check)."""
    axes = tuple(sorted(jax.typeof(reference).manual_axis_type.varying))
    return jax.lax.pcast(tree, axes, to="varying") if axes else tree


def _xla_backward(q_in, k_in, v_in, out_BSKGE, lse_BKGS, dout_BSKGE, causal: bool, chunk: int, segments=None):
    """Probabilities recomputed chunk by chunk from the global lse; dq accumulated, dk/dv per chunk."""
    q_BSKGE, k_BTKE, v_BTKE, do_BSKGE = (x.astype(jnp.float32) for x in (q_in, k_in, v_in, dout_BSKGE))
    delta_BKGS = jnp.einsum("bskge->bkgs", do_BSKGE * out_BSKGE.astype(jnp.float32))
    scale = q_BSKGE.shape[-1] ** -0.5
    qpos_S = _local_positions(q_BSKGE.shape[1], q_BSKGE)
    k_NBCKE, kpos_NC = _chunked(k_BTKE, jnp.arange(k_BTKE.shape[1]), chunk)
    v_NBCKE, _ = _chunked(v_BTKE, kpos_NC.reshape(-1), chunk)
    qseg_BS, kseg_NBC = _chunked_segments(segments, kpos_NC, chunk)

    def step(dq_BSKGE, chunk_xs):
        k_CKE, v_CKE, kpos_C, kseg_BC = chunk_xs
        scores, mask = _scores(q_BSKGE, qpos_S, k_CKE, kpos_C, causal, qseg_BS, kseg_BC)
        probs = jnp.exp(scores - lse_BKGS[..., None])
        if mask is not None:
            probs = jnp.where(mask, probs, 0.0)
        dv_CKE = jnp.einsum("bkgsc,bskge->bcke", probs, do_BSKGE)
        dprobs = jnp.einsum("bskge,bcke->bkgsc", do_BSKGE, v_CKE)
        dscores = probs * (dprobs - delta_BKGS[..., None]) * scale
        dq_BSKGE = dq_BSKGE + jnp.einsum("bkgsc,bcke->bskge", dscores, k_CKE)
        dk_CKE = jnp.einsum("bkgsc,bskge->bcke", dscores, q_BSKGE)
        return dq_BSKGE, (dk_CKE, dv_CKE)

    dq, (dk_NBCKE, dv_NBCKE) = jax.lax.scan(step, jnp.zeros_like(q_BSKGE), (k_NBCKE, v_NBCKE, kpos_NC, kseg_NBC))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(k_BTKE.shape)
    return dq, unchunk(dk_NBCKE), unchunk(dv_NBCKE)


# ---- cuDNN kernel ----------------------------------------------------------------------------------------------------
def cudnn_options(head_dim: int, causal: bool) -> dict:
    cudnn = cudnn_module()
    mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
    return {"scale": head_dim**-0.5, "seed": 0, "dropout_rate": 0.0, "variadic_args": (False, False),
            "mask_type": mask, "layout": cudnn.AttentionLayout.BTNH.value, "sliding_window_length": None}


def _unused_operands(dtype) -> list[jax.Array]:
    """bias, q/kv sequence lengths, q/kv offsets, k/v page tables: all absent (empty arrays, as JAX passes them)."""
    return [jnp.zeros(0, dtype)] * 7


def _cudnn_forward(q_BSKGE, k_BTKE, v_BTKE, causal: bool):
    cudnn = cudnn_module()
    batch, length, kv_heads, groups, head_dim = q_BSKGE.shape
    check_cudnn_inputs(q_BSKGE.dtype, head_dim)
    q_BSNE = q_BSKGE.reshape(batch, length, kv_heads * groups, head_dim)  # head n = k * G + g: cuDNN's GQA grouping
    out_BSNE, stats_BNS = cudnn._dot_product_attention_fwd_p_wrapper.bind(
        q_BSNE, k_BTKE, v_BTKE, *_unused_operands(q_BSKGE.dtype), is_training=True,
        **cudnn_options(head_dim, causal))
    return out_BSNE.reshape(q_BSKGE.shape), stats_BNS.reshape(batch, kv_heads, groups, length)


def _cudnn_backward(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, dout_BSKGE, causal: bool):
    grads = _cudnn_backward_native(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, dout_BSKGE, causal)
    return tuple(x.astype(jnp.float32) for x in grads)


def _cudnn_backward_native(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, dout_BSKGE, causal: bool):
    """(dq, dk, dv) in the inputs' dtype, as the kernel returns them."""
    cudnn = cudnn_module()
    batch, length, kv_heads, groups, head_dim = q_BSKGE.shape
    as_heads = lambda x: x.astype(q_BSKGE.dtype).reshape(batch, length, kv_heads * groups, head_dim)
    dq_BSNE, dk_BTKE, dv_BTKE = cudnn._dot_product_attention_bwd_p_wrapper.bind(
        as_heads(q_BSKGE), k_BTKE, v_BTKE, *_unused_operands(q_BSKGE.dtype),
        lse_BKGS.reshape(batch, kv_heads * groups, length), as_heads(out_BSKGE), as_heads(dout_BSKGE),
        **cudnn_options(head_dim, causal))
    return dq_BSNE.reshape(q_BSKGE.shape), dk_BTKE, dv_BTKE


# ---- one whole-sequence block on cuDNN, inside an enclosing manual region (a pipeline stage) ------------------------
# Why this shape: inside a pipeline's shard_map (manual over `pipeline`, maybe `data`), XLA cannot run the custom
# partitioning rule that `jax.nn.dot_product_attention` puts around cuDNN's kernel (jax 0.10.2: an AssertionError in
# the partitioner). So the kernel's primitives are bound directly, on local arrays of a nested region manual over
# every remaining mesh axis. The custom VJP sits *outside* that nested region, which runs once in the forward (out and
# the fp32 lse as explicit outputs) and once in the backward: differentiating through a nested shard_map instead makes
# JAX 0.10.2 size the region's residuals by every mesh axis, the enclosing manual ones too, and the module fails the
# MLIR verifier ("type of return operand ... doesn't match function result type").
# The names the region's outputs carry, for remat policies: `minimal_with_context` keeps them by name in a pipeline
# (matching the kernel's primitive there would split the nested region, which fails as above).
REGION_NAMES = ("fused_attention_out", "fused_attention_lse")


@dataclasses.dataclass(frozen=True)
class RegionLayout:
    """How the nested region lays out the block: its mesh, its manual axes, the batch and kv-head entries, and the
    block kernel (`cudnn` on GPUs; `xla` lets a CPU test run the same region and custom VJP)."""

    mesh: Any
    manual: frozenset
    batch: tuple | None
    heads: tuple | None
    implementation: str = "cudnn"

    def specs(self) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
        """(queries B S K G E, keys B T K E, lse B K G S): sequence and head_dim whole on every device."""
        batch, heads = self.batch, self.heads
        return (PartitionSpec(batch, None, heads, None, None), PartitionSpec(batch, None, heads, None),
                PartitionSpec(batch, heads, None, None))

    def region(self, body, in_specs, out_specs):
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(self.manual))


def region_fused_attention(q_BSKGE, k_BTKE, v_BTKE, causal: bool, kv_spec: PartitionSpec | None = None,
                           implementation: str = "cudnn") -> jax.Array:
    """Attention of whole sequences on one fused block kernel, from inside a shard_map that is manual over some axes.

    The nested region is manual over every axis of the enclosing abstract mesh that is not manual yet. `kv_spec`
    (the keys' activation spec, B T K E) lays out batch and kv heads there (entries naming the enclosing manual axes
    are dropped); the sequence and head_dim are whole on every device. Without a spec, everything is replicated.
    The output and the gradients come back in the inputs' dtypes.
    """
    if implementation == "cudnn":
        check_cudnn_inputs(q_BSKGE.dtype, q_BSKGE.shape[-1])
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    entries = list(kv_spec or ()) + [None] * (4 - len(kv_spec or ()))
    keep = lambda entry: tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in manual) or None
    layout = RegionLayout(mesh, manual, keep(entries[0]), keep(entries[2]), implementation)
    return _region_attention(q_BSKGE, k_BTKE, v_BTKE, causal, layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _region_attention(q_BSKGE, k_BTKE, v_BTKE, causal: bool, layout: RegionLayout):
    return _region_forward(q_BSKGE, k_BTKE, v_BTKE, causal, layout)[0]


def _region_forward(q_BSKGE, k_BTKE, v_BTKE, causal, layout):
    q_spec, kv_spec, lse_spec = layout.specs()

    def kernel(q_BSKGE, k_BTKE, v_BTKE):
        out_BSKGE, lse_BKGS = block_forward(q_BSKGE, k_BTKE, v_BTKE, causal, layout.implementation)
        return out_BSKGE.astype(q_BSKGE.dtype), lse_BKGS

    forward = layout.region(kernel, (q_spec, kv_spec, kv_spec), (q_spec, lse_spec))
    out_BSKGE, lse_BKGS = (checkpoint_name(x, name) for x, name in zip(forward(q_BSKGE, k_BTKE, v_BTKE), REGION_NAMES))
    return out_BSKGE, (q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS)


def _region_backward(causal, layout, residuals, dout_BSKGE):
    q_spec, kv_spec, lse_spec = layout.specs()

    def kernel(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, dout_BSKGE):
        if layout.implementation == "cudnn":  # already in the inputs' dtypes
            return _cudnn_backward_native(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, dout_BSKGE, causal)
        grads = block_backward(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, dout_BSKGE, causal, layout.implementation)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, (q_BSKGE, k_BTKE, v_BTKE)))

    backward = layout.region(kernel, (q_spec, kv_spec, kv_spec, q_spec, lse_spec, q_spec), (q_spec, kv_spec, kv_spec))
    return backward(*residuals, dout_BSKGE)


_region_attention.defvjp(_region_forward, _region_backward)
