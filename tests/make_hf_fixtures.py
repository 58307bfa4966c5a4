"""Make the tiny Hugging Face Llama checkpoints under tests/data/hf/ that tests/test_hf.py imports (run once).

Needs torch and transformers, which are NOT shardkit dependencies; the tests read only what this writes:

    pip install torch transformers
    python tests/make_hf_fixtures.py

For each fixture (`untied`: its own lm_head, saved in several safetensors shards with an index; `tied`: lm_head is
the embedding, one file, config.json in transformers 4's spelling), both with llama3 rope scaling whose original context
is short enough that the fixed 16-token input crosses all three frequency bands, it writes the `save_pretrained`
directory plus

    tokens.npy   int32 (2, 16)        fixed input tokens
    logits.npy   float32 (2, 16, V)   LlamaForCausalLM's logits on them (fp32, eager attention)

The weights are drawn at unit scale (1/sqrt(fan_in), norms around 1), not Hugging Face's 0.02, so that the logits are
O(1) and a mismatch anywhere shows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

OUT = Path(__file__).resolve().parent / "data" / "hf"
COMMON = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=512, hidden_act="silu",
    bos_token_id=1, eos_token_id=2,
    rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)
# name: (LlamaConfig changes, config.json in transformers 4's rope spelling)
FIXTURES = {"untied": (dict(tie_word_embeddings=False), False), "tied": (dict(tie_word_embeddings=True), True)}
SHARD_SIZE = "20KB"  # small enough that the untied fixture is split into several files with an index


def unit_scale_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every weight: matrices N(0, 1/fan_in) (embeddings N(0, 1/hidden)), norm scales 1 + N(0, 0.1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.ndim == 1:
                weight.copy_(1 + 0.1 * torch.randn(weight.shape, generator=generator))
            else:
                weight.copy_(torch.randn(weight.shape, generator=generator) / math.sqrt(weight.shape[1]))


def write_legacy_rope_config(path: Path) -> None:
    """Rewrite transformers 5's `rope_parameters` as the `rope_theta` + `rope_scaling` pair that transformers 4
    wrote (and that Meta's Llama 3 checkpoints on the Hub carry), so the tests read both spellings."""
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def make(name: str, extra: dict, seed: int, legacy_config: bool) -> None:
    config = LlamaConfig(**COMMON, **extra)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    unit_scale_(model, seed)
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (2, 16)).astype(np.int32)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens).long()).logits.numpy().astype(np.float32)
    directory = OUT / name
    shard = SHARD_SIZE if not config.tie_word_embeddings else "10MB"
    model.save_pretrained(directory, max_shard_size=shard)
    if legacy_config:
        write_legacy_rope_config(directory / "config.json")
    np.save(directory / "tokens.npy", tokens)
    np.save(directory / "logits.npy", logits)
    print(f"{directory}: {sorted(p.name for p in directory.iterdir())}, logits std {logits.std():.3f}")


if __name__ == "__main__":
    for index, (fixture, (changes, legacy)) in enumerate(FIXTURES.items()):
        make(fixture, changes, seed=index, legacy_config=legacy)
