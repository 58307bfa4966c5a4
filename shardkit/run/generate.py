"""`shardkit generate RUN --prompt TEXT`: continue a prompt with a run's latest checkpoint (greedy or sampled).

The quickest check that a fine-tuned model works, not a serving engine. Generation runs under the run's own resolved
layout (`Layout.context(training=False)`: the recipe's rules, precision policy and attention kernel) on this host's
devices, one prompt at a time: the batch and sequence axes have one row and one token to split, so the layout keeps
only the recipe's `tensor` degree (when this host has the devices) and folds the others to 1.

With the KV cache (the default) the prompt is prefilled once and each new token runs the model on that token alone,
attending to the cached keys and values of the ones before it (`Llama.decode`); the cache is laid out like attention,
heads over `tensor`. `--no-kv-cache` keeps the old path for checking: every new token reruns the model over a
fixed-length buffer (prompt + max_tokens, padded on the right; causal attention makes the padding invisible). Both
compile once. The tokenizer is the one `shardkit data prepare` copied beside the run's `data.path` (or
`--tokenizer`); generation stops at its end-of-document token. A run on `data.source = "text"` needs none: its tokens
are the text's UTF-8 bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardkit.errors import ShardkitError
from shardkit.hf.export import load_run_params
from shardkit.data.prepare import EOS_CANDIDATES, TOKENIZER_FILE, read_meta
from shardkit.layout import Layout, build_layout
from shardkit.recipe import recipe_from_tables


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


def generate(run_dir: str | Path, prompt: str, sampling: Sampling = Sampling(), tokenizer_path: str | None = None,
             step: int | None = None) -> str:
    """The completion (text after the prompt) of the run's checkpoint at `step` (default: the latest).

    Raises:
        ShardkitError: no checkpoint, no tokenizer, or an empty prompt.
    """
    run_dir = Path(run_dir)
    _, meta, params = load_run_params(run_dir, step)
    tokenizer, eos_id = load_tokenizer(meta, tokenizer_path)
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise ShardkitError("--prompt", "is empty after tokenization")
    new_ids = generate_ids(meta, params, prompt_ids, sampling, eos_id)
    return tokenizer.decode(new_ids)


def generation_layout(meta: dict[str, Any], devices=None) -> Layout:
    """The run's recipe (from its checkpoint metadata) as one prompt's layout on this host's `devices` (default: all
    local ones): the recipe's `tensor` degree when there are that many devices, every other mesh axis 1."""
    devices = list(jax.local_devices() if devices is None else devices)
    tables = copy.deepcopy(meta["recipe"]["tables"])
    tensor = int(tables.get("mesh", {}).get("tensor", 1))
    tensor = tensor if 0 < tensor <= len(devices) else 1
    tables["mesh"] = {"tensor": tensor}
    return build_layout(recipe_from_tables(tables, meta["recipe"]["name"]), devices[:tensor])


def generate_ids(meta: dict[str, Any], params, prompt_ids: list[int], sampling: Sampling, eos_id: int | None,
                 layout: Layout | None = None) -> list[int]:
    """New token ids after `prompt_ids` (stopping after `eos_id`, which is not returned), under `layout` (default:
    `generation_layout(meta)`)."""
    layout = generation_layout(meta) if layout is None else layout
    return Generator(layout, sampling)(params, prompt_ids, eos_id)


class Generator:
    """Generation under one layout and sampling: compiles its steps once and keeps them for every later prompt.

    Each token is picked inside the compiled step (argmax, or a sample keyed by the seed folded with the position),
    so the two paths pick alike from equal logits and only one integer comes back to the host per token.
    """

    def __init__(self, layout: Layout, sampling: Sampling):
        self.layout, self.sampling = layout, sampling
        self._pick = functools.partial(_pick, temperature=sampling.temperature, key=jax.random.key(sampling.seed))
        self._recomputed_step = jax.jit(self._recomputed)
        self._cached_step = jax.jit(self._cached, donate_argnums=1)

    def __call__(self, params, prompt_ids: list[int], eos_id: int | None) -> list[int]:
        """New token ids after `prompt_ids`, stopping after `eos_id` (not returned) or `max_tokens`."""
        layout = self.layout
        if max(prompt_ids) >= layout.config.vocab:
            raise ShardkitError("--tokenizer", f"token id {max(prompt_ids)} is outside the model's vocab "
                                f"{layout.config.vocab}")
        params = jax.device_put(layout.policy.cast_to_compute(jax.tree.map(jnp.asarray, params)),
                                layout.param_shardings)
        length = len(prompt_ids) + self.sampling.max_tokens
        next_token = (self._with_cache if self.sampling.kv_cache else self._without_cache)(params, prompt_ids, length)
        new_ids = []
        for position in range(len(prompt_ids), length):
            token = int(next_token(new_ids[-1] if new_ids else None, position))
            if token == eos_id:
                break
            new_ids.append(token)
        return new_ids

    def _without_cache(self, params, prompt_ids: list[int], length: int) -> NextToken:
        """Each token from the whole buffer rerun through the model."""
        buffer = np.zeros((1, length), np.int32)
        buffer[0, : len(prompt_ids)] = prompt_ids

        def next_token(token, position):
            if token is not None:
                buffer[0, position - 1] = token
            return self._recomputed_step(params, jnp.asarray(buffer), jnp.int32(position))

        return next_token

    def _recomputed(self, params, tokens_1L: jax.Array, position: jax.Array) -> jax.Array:
        with self.layout.context(training=False):
            logits_LV = nnx.merge(self.layout.graphdef, params)(tokens_1L)[0]
        return self._pick(logits_LV[position - 1].astype(jnp.float32), position)

    def _with_cache(self, params, prompt_ids: list[int], length: int) -> NextToken:
        """Each token from the model run on the one before it against the KV cache (the prompt prefilled first)."""
        layout = self.layout
        model = nnx.merge(layout.graphdef, params)
        layers = getattr(model, getattr(model, "LAYER_STACK", ""), None)
        if not (hasattr(model, "decode") and hasattr(layers, "decode")):
            # A model of the user's own without the cache protocol still generates, by recomputing: the same tokens.
            warnings.warn(f"generate: {layout.model_class.__name__} and its layers have no `decode` for a KV cache; "
                          "recomputing the whole sequence for each token (as --no-kv-cache)", stacklevel=1)
            return self._without_cache(params, prompt_ids, length)
        cache = [model.empty_cache(1, length, layout.policy.compute_dtype)]

        def next_token(token, position):
            if token is None:  # prefill: the whole prompt at once
                tokens_1S, start = jnp.asarray([prompt_ids], jnp.int32), 0
            else:
                tokens_1S, start = jnp.asarray([[token]], jnp.int32), position - 1
            picked, cache[0] = self._cached_step(params, cache[0], tokens_1S, jnp.int32(start))
            return picked

        return next_token

    def _cached(self, params, cache, tokens_1S: jax.Array, start: jax.Array):
        with self.layout.context(training=False):
            logits_1V, cache = nnx.merge(self.layout.graphdef, params).decode(tokens_1S, cache, start)
        return self._pick(logits_1V[0].astype(jnp.float32), start + tokens_1S.shape[1]), cache


# (the token at position - 1, None before the first, position) -> the token picked for `position`
NextToken = Callable[[int | None, int], jax.Array]


def _pick(logits_V: jax.Array, position: jax.Array, temperature: float, key: jax.Array) -> jax.Array:
    """Greedy (temperature 0) or sampled token for `position`; the key is folded with it, so both paths draw alike."""
    if temperature == 0.0:
        return jnp.argmax(logits_V)
    return jax.random.categorical(jax.random.fold_in(key, position), logits_V / temperature)


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
        return next((self.tokenizer.token_to_id(t) for t in EOS_CANDIDATES if self.tokenizer.token_to_id(t) is not None),
                    None)


def load_tokenizer(meta: dict[str, Any], tokenizer_path: str | None) -> tuple[ByteTokenizer | FileTokenizer, int | None]:
    """(tokenizer, eos id or None): `tokenizer_path`; else the UTF-8 bytes of a `text` run (its eos: the recipe's
    `data.eos_id`, if any); else the tokenizer `data prepare` put beside the run's data.path."""
    eos_id = None
    data = meta.get("recipe", {}).get("tables", {}).get("data", {})
    if tokenizer_path is None and data.get("source") == "text":
        return ByteTokenizer(), data.get("eos_id")
    if tokenizer_path is None:
        data_meta = read_meta(data["path"]) if data.get("source") == "bin" and data.get("path") else None
        if data_meta is None:
            raise ShardkitError(
                "--tokenizer", "the run's data has no `shardkit data prepare` metadata; pass --tokenizer tokenizer.json"
            )
        tokenizer_path = str(Path(data["path"]).parent / data_meta.get("tokenizer", TOKENIZER_FILE))
        eos_id = data_meta.get("eos_id")
    if not Path(tokenizer_path).is_file():
        raise ShardkitError("--tokenizer", f"no tokenizer file at {tokenizer_path!r}")
    tokenizer = FileTokenizer(tokenizer_path)
    return tokenizer, tokenizer.eos_id() if eos_id is None else eos_id
