"""`shardkit generate RUN --prompt TEXT`: continue prompts with a run's latest checkpoint (greedy or sampled).

The quickest check that a fine-tuned model works, not a serving engine. Generation runs under the run's own resolved
layout (`Layout.context(training=False)`: the recipe's rules, precision policy and attention kernel) on this host's
devices: the batch holds the prompts and each step one token, too little to split, so the layout keeps only the
recipe's `tensor` degree (when this host has the devices) and folds the others to 1.

Several prompts run as one batch, right-padded to the longest: row b's tokens sit at positions 0 .. len_b - 1 as they
would alone, and each row writes its new tokens at its own next position. With the KV cache (the default) the whole
generation is one compiled program: the padded prompts are prefilled at once, then a `jax.lax.while_loop` runs one
token per row per iteration against the cache (`Llama.decode`, laid out like attention, heads over `tensor`), picks
each token on the device, and stops when every row has produced the end-of-document token or `max_tokens`; the new
tokens come back to the host in one transfer at the end. `--no-kv-cache` keeps the host loop for checking: every new
token reruns the model over a fixed-length buffer (prompt + max_tokens, padded on the right; causal attention makes
the padding invisible). The tokenizer is the one `shardkit data prepare` copied beside the run's `data.path` (or
`--tokenizer`); generation stops at its end-of-document token. A model whose config states a position limit
(`max_len`, `max_position_embeddings`, ...: `shardkit.layout.position_limit`) stops there, saying so, so that no
position past its table is ever computed (causal attention would carry a NaN there back into earlier positions); logits
that are not finite stop generation with one line. A run on `data.source = "text"` needs none: its tokens
are the text's UTF-8 bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardkit.data.prepare import EOS_CANDIDATES, TOKENIZER_FILE, read_meta
from shardkit.errors import ShardkitError
from shardkit.hf.export import load_run_params
from shardkit.layout import Layout, build_layout, position_limit
from shardkit.recipe import recipe_from_tables

# The end-of-document id when there is none: no token ever equals it.
NO_EOS = -1


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax); > 0: sample from softmax(logits / temperature) with `seed`. `kv_cache` False
    reruns the whole sequence for every token (the check that the cache changes nothing)."""

    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    kv_cache: bool = True

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ShardkitError("--max-tokens", f"must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ShardkitError("--temperature", f"must be >= 0, got {self.temperature}")


def generate(run_dir: str | Path, prompts: list[str], sampling: Sampling = Sampling(),
             tokenizer_path: str | None = None, step: int | None = None) -> list[str]:
    """The completions (text after each prompt) of the run's checkpoint at `step` (default: the latest), the prompts
    run as one batch.

    Raises:
        ShardkitError: no checkpoint, no tokenizer, no prompt, or an empty one.
    """
    if not prompts:
        raise ShardkitError("--prompt", "give at least one prompt (--prompt TEXT or --prompts-file FILE)")
    _, meta, params = load_run_params(Path(run_dir), step)
    tokenizer, eos_id = load_tokenizer(meta, tokenizer_path)
    prompt_ids = [tokenizer.encode(prompt) for prompt in prompts]
    for number, ids in enumerate(prompt_ids, 1):
        if not ids:
            raise ShardkitError("--prompt", f"prompt {number} is empty after tokenization")
    return [tokenizer.decode(ids) for ids in generate_ids(meta, params, prompt_ids, sampling, eos_id)]


def generation_layout(meta: dict[str, Any], devices=None) -> Layout:
    """The run's recipe (from its checkpoint metadata) as a generation layout on this host's `devices` (default: all
    local ones): the recipe's `tensor` degree when there are that many devices, every other mesh axis 1."""
    devices = list(jax.local_devices() if devices is None else devices)
    tables = copy.deepcopy(meta["recipe"]["tables"])
    tensor = int(tables.get("mesh", {}).get("tensor", 1))
    tensor = tensor if 0 < tensor <= len(devices) else 1
    tables["mesh"] = {"tensor": tensor}
    return build_layout(recipe_from_tables(tables, meta["recipe"]["name"]), devices[:tensor])


def generate_ids(meta: dict[str, Any], params, prompt_ids: list[list[int]], sampling: Sampling, eos_id: int | None,
                 layout: Layout | None = None) -> list[list[int]]:
    """New token ids after each of `prompt_ids` (each stopping after `eos_id`, which is not returned), under `layout`
    (default: `generation_layout(meta)`)."""
    layout = generation_layout(meta) if layout is None else layout
    return Generator(layout, sampling)(params, prompt_ids, eos_id)


class Prompts(NamedTuple):
    """A batch of prompts right-padded to the longest: tokens_BP (padding 0) and each row's length."""

    tokens_BP: np.ndarray
    lengths_B: np.ndarray

    @classmethod
    def pad(cls, prompt_ids: list[list[int]]) -> Prompts:
        lengths_B = np.asarray([len(ids) for ids in prompt_ids], np.int32)
        tokens_BP = np.zeros((len(prompt_ids), lengths_B.max()), np.int32)
        for row, ids in enumerate(prompt_ids):
            tokens_BP[row, : len(ids)] = ids
        return cls(tokens_BP, lengths_B)


class DecodeState(NamedTuple):
    """What the decode loop carries: the iteration, the token each row feeds next, the cache, the new tokens so far
    (B, max_tokens) and which rows have produced the end-of-document token."""

    step: jax.Array
    token_B: jax.Array
    cache: Any
    new_BN: jax.Array
    done_B: jax.Array
    finite: jax.Array  # every logit so far finite


class Generator:
    """Generation under one layout and sampling: compiles its program once per batch shape and keeps it.

    Each token is picked on the device (argmax, or a sample keyed by the seed folded with the row and the token's
    position), so the two paths pick alike from equal logits.
    """

    def __init__(self, layout: Layout, sampling: Sampling):
        self.layout, self.sampling = layout, sampling
        self._pick = functools.partial(_pick, temperature=sampling.temperature, key=jax.random.key(sampling.seed))
        self._recomputed_step = jax.jit(self._recomputed)
        self._on_device = jax.jit(self._decode_loop, static_argnums=3)

    def __call__(self, params, prompt_ids: list[list[int]], eos_id: int | None) -> list[list[int]]:
        """New token ids after each of `prompt_ids`, each row stopping after `eos_id` (not returned) or `max_tokens`."""
        return self.run(self.place(params), prompt_ids, eos_id)

    def place(self, params):
        """The parameters in the compute dtype, laid out on the layout's devices (what `run` takes)."""
        layout = self.layout
        return jax.device_put(layout.policy.cast_to_compute(jax.tree.map(jnp.asarray, params)), layout.param_shardings)

    def run(self, params, prompt_ids: list[list[int]], eos_id: int | None) -> list[list[int]]:
        """`__call__` with parameters already placed (`place`): what a benchmark times."""
        highest = max(max(ids) for ids in prompt_ids)
        if highest >= self.layout.vocab:
            raise ShardkitError("--tokenizer", f"token id {highest} is outside the model's vocab "
                                f"{self.layout.vocab}")
        prompts = Prompts.pad(prompt_ids)
        eos = NO_EOS if eos_id is None else eos_id
        max_tokens = self._within_positions(prompts)
        if self.sampling.kv_cache and self._can_decode():
            new_BN, finite = self._on_device(params, jnp.asarray(prompts.tokens_BP), jnp.asarray(prompts.lengths_B),
                                             max_tokens, jnp.int32(eos))
            new_BN = np.asarray(jax.device_get(new_BN))  # the one transfer of the whole generation
            if not bool(finite):
                raise _non_finite()
        else:
            new_BN = self._host_loop(params, prompts, eos, max_tokens)
        return [_until(row.tolist(), eos) for row in new_BN]

    def _within_positions(self, prompts: Prompts) -> int:
        """The new tokens the model's position limit (`layout.position_limit`) leaves room for, at most
        `max_tokens`; a stop before `max_tokens` is said once.

        Raises:
            ShardkitError: a prompt already fills the model's positions.
        """
        limit, max_tokens = position_limit(self.layout.config), self.sampling.max_tokens
        if limit is None:
            return max_tokens
        field, positions = limit
        room = positions - prompts.tokens_BP.shape[1]
        name = f"{type(self.layout.config).__name__}.{field} = {positions}"
        if room < 1:
            raise ShardkitError("--prompt", f"a prompt of {prompts.tokens_BP.shape[1]} tokens leaves no room within "
                                f"the model's {positions} positions ({name}); shorten it")
        if room < max_tokens:
            warnings.warn(f"generate: stopping after {room} new tokens of the {max_tokens} asked, at the model's "
                          f"position limit ({name})", stacklevel=3)
        return min(room, max_tokens)

    def _can_decode(self) -> bool:
        """Whether the model offers the KV-cache protocol (`decode` and `empty_cache`, and layers in its
        `LAYER_STACK` that decode); a model of the user's own without it still generates, by recomputing: the same
        tokens."""
        model = nnx.merge(self.layout.graphdef, self.layout.abstract_params)  # shapes only: nothing is computed
        layers = getattr(model, getattr(model, "LAYER_STACK", ""), None)
        if all(hasattr(model, name) for name in ("decode", "empty_cache")) and hasattr(layers, "decode"):
            return True
        warnings.warn(f"generate: {self.layout.model_class.__name__} and its layers have no `decode` for a KV cache; "
                      "recomputing the whole sequence for each token (as --no-kv-cache)", stacklevel=3)
        return False

    def _decode_loop(self, params, tokens_BP: jax.Array, lengths_B: jax.Array, max_tokens: int,
                     eos: jax.Array) -> jax.Array:
        """The whole generation on the device: prefill the padded prompts, then one token per row per iteration of a
        `while_loop` until every row is done. Row b's first iteration feeds its last prompt token again at position
        len_b - 1 (its logits are the first new token's; rewriting its key and value changes nothing), so every
        iteration is the same one-token step whatever the row's length. Rows already done pick `eos` again. Returns
        the new tokens and whether every logit was finite."""
        batch, rows_B = tokens_BP.shape[0], jnp.arange(tokens_BP.shape[0])
        with self.layout.context(training=False):
            model = nnx.merge(self.layout.graphdef, params)
            cache = model.empty_cache(batch, tokens_BP.shape[1] + max_tokens, self.layout.policy.compute_dtype)
            prefill_BPV, cache = model.decode(tokens_BP, cache, 0)

            def body(state: DecodeState) -> DecodeState:
                positions_B = lengths_B - 1 + state.step
                logits_BV, cache = model.decode(state.token_B[:, None], state.cache, positions_B)
                picked_B = self._pick(logits_BV.astype(jnp.float32), positions_B + 1, rows_B)
                picked_B = jnp.where(state.done_B, eos, picked_B).astype(jnp.int32)
                new_BN = jax.lax.dynamic_update_slice_in_dim(state.new_BN, picked_B[:, None], state.step, axis=1)
                finite = state.finite & jnp.all(jnp.isfinite(logits_BV))
                return DecodeState(state.step + 1, picked_B, cache, new_BN, state.done_B | (picked_B == eos), finite)

            def more(state: DecodeState) -> jax.Array:
                return (state.step < max_tokens) & ~jnp.all(state.done_B)

            start = DecodeState(jnp.int32(0), tokens_BP[rows_B, lengths_B - 1], cache,
                                jnp.full((batch, max_tokens), eos, jnp.int32), jnp.zeros((batch,), bool),
                                jnp.all(jnp.isfinite(prefill_BPV)))
            end = jax.lax.while_loop(more, body, start)
            return end.new_BN, end.finite

    def _host_loop(self, params, prompts: Prompts, eos: int, max_tokens: int) -> np.ndarray:
        """The check path: each token from the whole buffer rerun through the model, one dispatch per token.

        Raises:
            ShardkitError: the model's logits are not finite (no token is picked from NaN).
        """
        batch = len(prompts.lengths_B)
        buffer_BL = np.zeros((batch, prompts.tokens_BP.shape[1] + max_tokens), np.int32)
        buffer_BL[:, : prompts.tokens_BP.shape[1]] = prompts.tokens_BP
        new_BN = np.full((batch, max_tokens), eos, np.int32)
        done_B, rows_B = np.zeros(batch, bool), np.arange(batch)
        for step in range(max_tokens):
            positions_B = prompts.lengths_B + step  # where each row's next token goes
            picked_B, finite = self._recomputed_step(params, jnp.asarray(buffer_BL), jnp.asarray(positions_B))
            if not bool(finite):
                raise _non_finite()
            picked_B = np.asarray(picked_B)
            picked_B = np.where(done_B, eos, picked_B)
            buffer_BL[rows_B, positions_B], new_BN[:, step] = picked_B, picked_B
            done_B |= picked_B == eos
            if done_B.all():
                break
        return new_BN

    def _recomputed(self, params, tokens_BL: jax.Array, positions_B: jax.Array) -> jax.Array:
        with self.layout.context(training=False):
            logits_BLV = nnx.merge(self.layout.graphdef, params)(tokens_BL)
        rows_B = jnp.arange(tokens_BL.shape[0])
        # The next token's logits: at the last token's position, or at its own where the model shifts its inputs.
        at_B = positions_B if self.layout.inputs_shifted else positions_B - 1
        logits_BV = logits_BLV[rows_B, at_B].astype(jnp.float32)
        return self._pick(logits_BV, positions_B, rows_B), jnp.all(jnp.isfinite(logits_BV))


def _non_finite() -> ShardkitError:
    return ShardkitError("generate", "the model's logits are not finite (NaN or Inf), so no token can be picked; the "
                         "checkpoint holds non-finite weights, or the model's forward breaks on these positions")


def _until(ids: list[int], eos: int) -> list[int]:
    """The ids before the first `eos`."""
    return ids[: ids.index(eos)] if eos in ids else ids


def _pick(logits_BV: jax.Array, positions_B: jax.Array, rows_B: jax.Array, temperature: float,
          key: jax.Array) -> jax.Array:
    """Greedy (temperature 0) or sampled token of each row for its `position`; the key is folded with the row and
    the position, so both paths draw alike and a prompt draws the same whatever the other rows' lengths."""
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1)
    keys_B = jax.vmap(lambda row, position: jax.random.fold_in(jax.random.fold_in(key, row), position))(
        rows_B, positions_B)
    return jax.vmap(jax.random.categorical)(keys_B, logits_BV / temperature)


class ByteTokenizer:
    """A `data.source = "text"` run's tokens: the UTF-8 bytes of its file (shardkit/data/source.py), no tokenizer file.
    Decoding reads the ids as bytes (an id past 255, which such a run never trains on, reads as U+FFFD, as does a
    byte sequence that is not UTF-8)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        pieces, run = [], bytearray()
        for token in ids:
            if token < 256:
                run.append(token)
                continue
            pieces.append(run.decode("utf-8", errors="replace") + "\ufffd")
            run = bytearray()
        return "".join(pieces) + run.decode("utf-8", errors="replace")


class FileTokenizer:
    """A `tokenizer.json` (Hugging Face tokenizers), encoding without special tokens."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def eos_id(self) -> int | None:
        """The first of the usual end-of-document tokens the vocabulary has."""
        ids = (self.tokenizer.token_to_id(token) for token in EOS_CANDIDATES)
        return next((token_id for token_id in ids if token_id is not None), None)


def load_tokenizer(meta: dict[str, Any],
                   tokenizer_path: str | None) -> tuple[ByteTokenizer | FileTokenizer, int | None]:
    """(tokenizer, eos id or None): `tokenizer_path`; else the UTF-8 bytes of a `text` run (its eos: the recipe's
    `data.eos_id`, if any); else the tokenizer `data prepare` put beside the run's data.path."""
    eos_id = None
    data = meta.get("recipe", {}).get("tables", {}).get("data", {})
    if tokenizer_path is None and data.get("source") == "text":
        return ByteTokenizer(), data.get("eos_id")
    if tokenizer_path is None:
        data_meta = read_meta(data["path"]) if data.get("source") == "bin" and data.get("path") else None
        if data_meta is None:
            source = data.get("source", "synthetic")
            why = ("run trained on random token ids (data.source = 'synthetic'), which no tokenizer wrote" if
                   source == "synthetic" else "run's data has no `shardkit data prepare` metadata")
            raise ShardkitError("--tokenizer", f"the {why}; pass --tokenizer tokenizer.json")
        tokenizer_path = str(Path(data["path"]).parent / data_meta.get("tokenizer", TOKENIZER_FILE))
        eos_id = data_meta.get("eos_id")
    if not Path(tokenizer_path).is_file():
        raise ShardkitError("--tokenizer", f"no tokenizer file at {tokenizer_path!r}")
    tokenizer = FileTokenizer(tokenizer_path)
    return tokenizer, tokenizer.eos_id() if eos_id is None else eos_id
