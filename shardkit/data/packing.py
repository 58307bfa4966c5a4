"""Packed documents: where the documents of each row begin, as segment ids and restarting rotary positions.

Rows are cut from the token stream wherever they fall (`[data] packing = "documents"` cuts them as "none" does), so a
row holds the tail of one document, whole documents and the head of another, separated by the end-of-document token
`eos_id`. With packing, attention never crosses from one segment to another and rotary positions restart at 0 in
each.

The end-of-document token opens the next segment: it is position 0 of the document after it, as GPT-2's
<|endoftext|> is both separator and start. So no prediction reads another document: a document's last token predicts
the separator from that document alone, and the separator predicts the next document's first token from itself
alone. A row's loss is a sum over its segments, and reordering whole documents inside a row leaves it unchanged (what
tests/test_packing.py checks). Every target keeps its weight.

Segment ids and positions are a pure function of the tokens, computed on the device inside the loss: the batch stays
the (batch, seq_len + 1) token array on every path (gradient accumulation, per-replica loops, pipelines), costs no
extra transfer, and a resumed run sees the segments an uninterrupted one would.

Letters: B batch, S sequence.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from shardkit.data.prepare import read_meta
from shardkit.errors import ShardkitError
from shardkit.recipe import DataSection


@dataclasses.dataclass(frozen=True)
class Packing:
    """Documents packed into rows, separated by `eos_id`."""

    eos_id: int


class Documents(NamedTuple):
    """Each token's rotary position (0 at its segment's start) and segment id (non-decreasing along a row)."""

    positions_BS: jax.Array
    segments_BS: jax.Array


def documents(tokens_BS: jax.Array, eos_id: int) -> Documents:
    """The segments and positions of rows of tokens: a new segment starts at every `eos_id`."""
    starts_BS = tokens_BS == eos_id
    segments_BS = jnp.cumsum(starts_BS, axis=1, dtype=jnp.int32)
    index_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1], dtype=jnp.int32), tokens_BS.shape)
    start_BS = jax.lax.cummax(jnp.where(starts_BS, index_BS, 0), axis=1)
    return Documents(index_BS - start_BS, segments_BS)


def document_rows(packing: Packing | None, inputs_BS: jax.Array) -> tuple[jax.Array, ...]:
    """What the model's forward takes after the tokens: (positions_BS, segments_BS) when packing, else nothing."""
    return () if packing is None else tuple(documents(inputs_BS, packing.eos_id))


def packing_of(section: DataSection, vocab: int | None) -> Packing | None:
    """The recipe's packing, its end-of-document id from `data.eos_id` or the prepared dataset's meta.json.

    Raises:
        ShardkitError: on `data.eos_id` when packing has no end-of-document id, or one outside the vocab.
    """
    if section.packing == "none":
        return None
    eos_id = section.eos_id
    if eos_id is None:
        meta = read_meta(section.path) if section.source == "bin" else None
        eos_id = None if meta is None else meta.get("eos_id")
    if eos_id is None:
        raise ShardkitError("data.eos_id", "packing = 'documents' needs the end-of-document token id: set "
                            "data.eos_id, or train on a .bin from `shardkit data prepare` (its meta.json holds it)")
    if vocab is not None and not 0 <= int(eos_id) < vocab:
        raise ShardkitError("data.eos_id", f"must be a token id below the model's vocab {vocab}, got {eos_id}")
    return Packing(int(eos_id))
