"""Hugging Face `config.json` <-> models/llama.py's `LlamaConfig`, refusing what the model cannot represent.

Both spellings of the rotary settings are read: transformers 4's top-level `rope_theta` with `rope_scaling`
(what Meta's Llama 3 checkpoints carry) and transformers 5's `rope_parameters` holding both.
"""

from __future__ import annotations

from typing import Any, Mapping

from shardkit.errors import ShardkitError

SUPPORTED_ROPE_TYPES = ("default", "llama3")
# transformers' LlamaConfig defaults, used when a field is absent.
HF_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu"}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llama_config_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """LlamaConfig fields (models/llama.py) for a Hugging Face Llama config.json.

    Raises:
        ShardkitError: naming the config.json field that shardkit's Llama cannot represent.
    """
    _refuse_unsupported(hf)
    heads = _int(hf, "num_attention_heads")
    fields = {
        "layers": _int(hf, "num_hidden_layers"),
        "embed": _int(hf, "hidden_size"),
        "heads": heads,
        "kv_heads": _int(hf, "num_key_value_heads", heads),
        "head_dim": _int(hf, "head_dim", _int(hf, "hidden_size") // heads),
        "mlp": _int(hf, "intermediate_size"),
        "vocab": _int(hf, "vocab_size"),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", HF_DEFAULTS["tie_word_embeddings"])),
        "norm_eps": float(hf.get("rms_norm_eps", HF_DEFAULTS["rms_norm_eps"])),
    }
    return fields | _rope_fields(hf)


def _refuse_unsupported(hf: Mapping[str, Any]) -> None:
    if hf.get("model_type") != "llama":
        raise ShardkitError("config.json:model_type", f"must be 'llama', got {hf.get('model_type')!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ShardkitError(f"config.json:{flag}", "is true, but shardkit's Llama has no bias terms")
    if hf.get("hidden_act", HF_DEFAULTS["hidden_act"]) != "silu":
        raise ShardkitError("config.json:hidden_act", f"must be 'silu' (SwiGLU), got {hf.get('hidden_act')!r}")
    for key in ("partial_rotary_factor",):
        if hf.get(key, 1.0) != 1.0:
            raise ShardkitError(f"config.json:{key}", f"must be 1.0 (rotary over the whole head), got {hf.get(key)!r}")


def _rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    rope, field = _rope_table(hf)
    theta = rope.get("rope_theta", hf.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ShardkitError(f"config.json:{field}.rope_type", f"{rope_type!r} is not supported; valid: "
                                                              f"{list(SUPPORTED_ROPE_TYPES)}")
    fields = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "llama3":
        missing = [key for key in LLAMA3_KEYS if key not in rope]
        if missing:
            raise ShardkitError(f"config.json:{field}.{missing[0]}", "is required by llama3 rope scaling")
        fields |= {
            "rope_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_max_positions": int(rope["original_max_position_embeddings"]),
        }
    return fields


def _rope_table(hf: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    for field in ("rope_parameters", "rope_scaling"):
        value = hf.get(field)
        if value is not None:
            if not isinstance(value, Mapping):
                raise ShardkitError(f"config.json:{field}", f"must be a table, got {value!r}")
            return value, field
    return {}, "rope_scaling"


def _int(hf: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if value is None:
        raise ShardkitError(f"config.json:{key}", "is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ShardkitError(f"config.json:{key}", f"must be a positive integer, got {value!r}")
    return value


def hf_config(config: Any, original: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A Hugging Face config.json for a LlamaConfig: the `original` one (what an import kept) with every field the
    model defines set from `config`, in the original's rotary spelling (transformers 4's when there is none)."""
    out = dict(original or {})
    out.update({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
        "num_hidden_layers": config.layers, "hidden_size": config.embed, "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim, "intermediate_size": config.mlp,
        "vocab_size": config.vocab, "tie_word_embeddings": config.tie_embeddings, "rms_norm_eps": config.norm_eps,
    })
    out["torch_dtype" if "torch_dtype" in out else "dtype"] = "float32"  # what the export writes
    out.setdefault("max_position_embeddings", max(8192, config.rope_original_max_positions))
    rope = _hf_rope(config)
    if "rope_parameters" in out:
        out["rope_parameters"] = {"rope_theta": config.rope_theta, **(rope or {"rope_type": "default"})}
    else:
        out["rope_theta"], out["rope_scaling"] = config.rope_theta, rope
    return out


def _hf_rope(config: Any) -> dict[str, Any] | None:
    if config.rope_type == "default":
        return None
    return {
        "rope_type": "llama3", "factor": config.rope_factor, "low_freq_factor": config.rope_low_freq_factor,
        "high_freq_factor": config.rope_high_freq_factor,
        "original_max_position_embeddings": config.rope_original_max_positions,
    }
