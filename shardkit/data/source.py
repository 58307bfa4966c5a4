"""Training data: the batch at step s is a pure function of (seed, s), built only where it is needed.

Each row of the global batch is made by `row(step, index)`, so a resumed run sees exactly the batches an uninterrupted
one would, and `global_batch` assembles the array from per-device callbacks: each process produces only the rows its
own devices hold.

Sources:
    synthetic  a noisy permutation chain: token t+1 is perm[token t] with probability 0.9, else uniform.
               A model learns it quickly (the loss falls from ln(vocab) towards about 1).
    text       a UTF-8 file read as bytes (vocab >= 256), random windows.
    bin        a flat file of uint16 or uint32 token ids, memory-mapped, random windows.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardkit.data.prepare import read_meta
from shardkit.errors import ShardkitError
from shardkit.recipe import DataSection

FOLLOW_PROBABILITY = 0.9


class TokenSource:
    """Rows of seq_len + 1 tokens (inputs plus the shifted targets), each a pure function of (seed, step, row)."""

    def __init__(self, section: DataSection, vocab: int, seq_len: int, seed: int):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.source = section.source
        if section.source == "synthetic":
            self.permutation = np.random.default_rng([seed, 0x5EED]).permutation(vocab)
        else:
            self.tokens = _open_tokens(section, vocab)
            if len(self.tokens) < seq_len + 2:
                need = f"more than train.seq_len + 1 = {seq_len + 1}"
                raise ShardkitError("data.path", f"{section.path} holds {len(self.tokens)} tokens; need {need}")

    def row(self, step: int, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step, index])
        if self.source == "synthetic":
            return self._synthetic_row(rng)
        start = int(rng.integers(0, len(self.tokens) - self.seq_len - 1))
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)
        if window.max() >= self.vocab:
            raise ShardkitError("data.path", f"token id {int(window.max())} is outside the model's vocab {self.vocab}")
        return window

    def _synthetic_row(self, rng: np.random.Generator) -> np.ndarray:
        length = self.seq_len + 1
        follow = rng.random(length) < FOLLOW_PROBABILITY
        noise = rng.integers(0, self.vocab, length)
        out = np.empty(length, dtype=np.int32)
        out[0] = noise[0]
        for t in range(1, length):
            out[t] = self.permutation[out[t - 1]] if follow[t] else noise[t]
        return out

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        return np.stack([self.row(step, index) for index in range(start, stop)])

    def global_batch(self, step: int, batch: int, sharding: NamedSharding) -> jax.Array:
        """The (batch, seq_len + 1) token array of a step, each device's rows made by that device's callback."""
        shape = (batch, self.seq_len + 1)

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            rows = index[0].indices(batch)
            return self.rows(step, rows[0], rows[1])[:, index[1]]

        return jax.make_array_from_callback(shape, sharding, shard)


def _open_tokens(section: DataSection, vocab: int) -> np.ndarray:
    path = Path(section.path)
    if not path.is_file():
        raise ShardkitError("data.path", f"no file at {section.path!r}")
    if path.stat().st_size == 0:  # numpy cannot map an empty file; say so in the recipe's terms
        raise ShardkitError("data.path", f"{section.path} is empty; it needs more than train.seq_len + 1 tokens")
    if section.source == "text":
        if vocab < 256:
            raise ShardkitError("data.source", f"text is read as bytes and needs vocab >= 256; the model has {vocab}")
        return np.memmap(path, dtype=np.uint8, mode="r")
    _check_prepared(section, vocab)
    dtype = np.dtype(section.dtype)
    if path.stat().st_size % dtype.itemsize:
        raise ShardkitError("data.dtype", f"{section.path} is not a whole number of {section.dtype} tokens")
    return np.memmap(path, dtype=dtype, mode="r")


def _check_prepared(section: DataSection, vocab: int) -> None:
    """A .bin from `shardkit data prepare` has its tokenizer's vocab and dtype in meta.json: both must fit the run."""
    meta = read_meta(section.path)
    if meta is None:
        return
    if meta.get("vocab_size", 0) > vocab:
        raise ShardkitError(
            "data.path",
            f"{section.path} was tokenized with a vocab of {meta['vocab_size']}, larger than model.vocab={vocab}; "
            f"use --set model.vocab={meta['vocab_size']} (or more)",
        )
    if meta.get("dtype", section.dtype) != section.dtype:
        raise ShardkitError("data.dtype", f"{section.path} holds {meta['dtype']} tokens; set "
                                          f"data.dtype={meta['dtype']!r}")
