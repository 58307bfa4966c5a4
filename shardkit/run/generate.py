"""`shardkit generate RUN --prompt TEXT`: continue a prompt with a run's latest checkpoint (greedy or sampled).

The quickest check that a fine-tuned model works, not a serving engine: the parameters are gathered onto one device
and every new token reruns the model over a fixed-length buffer (prompt + max_tokens, padded on the right; causal
attention makes the padding invisible), so the forward pass compiles once and there is no KV cache. The tokenizer
is the one `shardkit data prepare` copied beside the run's `data.path` (or `--tokenizer`); generation stops at its
end-of-document token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.errors import ShardkitError
from shardkit.hf.export import load_run_params
from shardkit.layout import abstract_model
from shardkit.data.prepare import EOS_CANDIDATES, TOKENIZER_FILE, read_meta
from shardkit.registry import load_model_class


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax); > 0: sample from softmax(logits / temperature) with `seed`."""

    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0

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
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    if not prompt_ids:
        raise ShardkitError("--prompt", "is empty after tokenization")
    new_ids = generate_ids(meta, params, prompt_ids, sampling, eos_id)
    return tokenizer.decode(new_ids)


def generate_ids(meta: dict[str, Any], params, prompt_ids: list[int], sampling: Sampling, eos_id: int | None):
    """New token ids after `prompt_ids` (stopping after `eos_id`, which is not returned)."""
    from flax import nnx

    cls = load_model_class(meta["model"])
    config = cls.Config(**meta["config"])
    if max(prompt_ids) >= config.vocab:
        raise ShardkitError("--tokenizer", f"token id {max(prompt_ids)} is outside the model's vocab {config.vocab}")
    graphdef, _, _ = abstract_model(cls, config)
    model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
    length = len(prompt_ids) + sampling.max_tokens
    forward = jax.jit(lambda tokens_1L: model(tokens_1L)[0])
    buffer = np.zeros((1, length), np.int32)
    buffer[0, : len(prompt_ids)] = prompt_ids
    key = jax.random.key(sampling.seed)
    new_ids = []
    for position in range(len(prompt_ids), length):
        logits_V = forward(jnp.asarray(buffer))[position - 1].astype(jnp.float32)
        token = _pick(logits_V, sampling.temperature, jax.random.fold_in(key, position))
        if token == eos_id:
            break
        buffer[0, position] = token
        new_ids.append(token)
    return new_ids


def _pick(logits_V: jax.Array, temperature: float, key: jax.Array) -> int:
    if temperature == 0.0:
        return int(jnp.argmax(logits_V))
    return int(jax.random.categorical(key, logits_V / temperature))


def load_tokenizer(meta: dict[str, Any], tokenizer_path: str | None):
    """(tokenizer, eos id or None): `tokenizer_path`, or the one `data prepare` put beside the run's data.path."""
    from tokenizers import Tokenizer

    eos_id = None
    if tokenizer_path is None:
        data = meta.get("recipe", {}).get("tables", {}).get("data", {})
        data_meta = read_meta(data["path"]) if data.get("source") == "bin" and data.get("path") else None
        if data_meta is None:
            raise ShardkitError(
                "--tokenizer", "the run's data has no `shardkit data prepare` metadata; pass --tokenizer tokenizer.json"
            )
        tokenizer_path = str(Path(data["path"]).parent / data_meta.get("tokenizer", TOKENIZER_FILE))
        eos_id = data_meta.get("eos_id")
    if not Path(tokenizer_path).is_file():
        raise ShardkitError("--tokenizer", f"no tokenizer file at {tokenizer_path!r}")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    if eos_id is None:
        eos_id = next((tokenizer.token_to_id(t) for t in EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)
    return tokenizer, eos_id
