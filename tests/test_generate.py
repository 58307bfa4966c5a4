"""Generation on the device with a KV cache: one compiled loop picks exactly the tokens that the host loop picks (200
greedy tokens, and sampled ones), for a batch of right-padded prompts each row what its prompt gives alone, each row
stopping at the end-of-document token; its logits equal the full forward pass's at every position, and the cache is
laid out like attention (heads over `tensor`). Tiny model, fp32, one or two CPU devices."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from shardkit.errors import ShardkitError
from shardkit.layout import build_layout, init_params
from shardkit.recipe import load_recipe
from shardkit.run.generate import Generator, Sampling, generate, generation_layout, load_tokenizer
from shardkit.run.loop import train
from tests.helpers import ROOT

PROMPT_LENGTH = 16
# Two layers: the prefill's and the decode loop's scans still carry one cache per layer, each written at its own index.
SMALL = ("model.layers=2",)


def _setup(tensor: int):
    overrides = [f"mesh.tensor={tensor}", "precision.policy=float32", *SMALL]
    recipe = load_recipe(ROOT / "recipes" / "fsdp_tp.toml", overrides)
    layout = build_layout(recipe, jax.devices()[:tensor])
    prompt = np.random.default_rng(0).integers(0, layout.config.vocab, PROMPT_LENGTH).tolist()
    return layout, init_params(layout, seed=0), prompt


@pytest.fixture(scope="module")
def one_device():
    return _setup(tensor=1)


def _host_loop_with_cache(layout, params, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference: one prompt alone, prefilled at its own length, then one dispatch and one transfer per greedy
    token against the cache, each picked on the host."""
    decode = _jitted_decode(layout)
    cache = nnx.merge(layout.graphdef, params).empty_cache(1, len(prompt) + max_tokens, jnp.float32)
    logits_1V, cache = decode(params, cache, jnp.asarray([prompt], jnp.int32), 0)
    new = []
    for position in range(len(prompt), len(prompt) + max_tokens):
        new.append(int(jnp.argmax(logits_1V[0])))
        logits_1V, cache = decode(params, cache, jnp.asarray([[new[-1]]], jnp.int32), position)
    return new


def _jitted_decode(layout):
    def decode(params, cache, tokens_1S, start):
        with layout.context(training=False):
            return nnx.merge(layout.graphdef, params).decode(tokens_1S, cache, start)

    return jax.jit(decode)


def _prompts(vocab: int, lengths=(PROMPT_LENGTH, 5, 11)) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, length).tolist() for length in lengths]


def test_200_greedy_tokens_are_the_same_with_and_without_the_cache(one_device):
    layout, params, prompt = one_device
    cached = Generator(layout, Sampling(max_tokens=200))(params, [prompt], None)
    recomputed = Generator(layout, Sampling(max_tokens=200, kv_cache=False))(params, [prompt], None)
    assert len(cached[0]) == 200
    assert cached == recomputed


def test_a_batch_of_right_padded_prompts_gives_each_prompt_its_own_tokens(one_device):
    """Prompts of three lengths in one batch: each row's tokens are those of its prompt generated alone by the host
    loop (positions and masks right for each row), and those of the recomputing path on the same batch."""
    layout, params, _ = one_device
    prompts = _prompts(layout.config.vocab)
    batched = Generator(layout, Sampling(max_tokens=24))(params, prompts, None)
    assert batched == [_host_loop_with_cache(layout, params, prompt, 24) for prompt in prompts]
    assert batched == Generator(layout, Sampling(max_tokens=24, kv_cache=False))(params, prompts, None)


def test_sampled_tokens_are_the_same_with_and_without_the_cache(one_device):
    layout, params, prompt = one_device
    prompts = [prompt, *_prompts(layout.config.vocab, (7,))]
    sampling = {"max_tokens": 24, "temperature": 1.0, "seed": 3}
    cached = Generator(layout, Sampling(**sampling))(params, prompts, None)
    assert cached == Generator(layout, Sampling(**sampling, kv_cache=False))(params, prompts, None)
    assert cached != Generator(layout, Sampling(max_tokens=24))(params, prompts, None)  # really sampled


def test_each_row_stops_at_the_end_of_document_token_on_the_device(one_device):
    layout, params, _ = one_device
    prompts = _prompts(layout.config.vocab)
    free = Generator(layout, Sampling(max_tokens=24))(params, prompts, None)
    eos = free[1][6]  # row 1 stops before its seventh token; the others at their first `eos`, if any
    stopped = Generator(layout, Sampling(max_tokens=24))(params, prompts, eos)
    assert stopped == [row[: row.index(eos)] if eos in row else row for row in free]
    assert len(stopped[1]) <= 6
    assert stopped == Generator(layout, Sampling(max_tokens=24, kv_cache=False))(params, prompts, eos)


def test_generation_is_one_compiled_loop(one_device):
    """Prefill and every decoding step in one program: a single while loop, no per-token dispatch."""
    layout, params, prompt = one_device
    generator = Generator(layout, Sampling(max_tokens=8))
    tokens_BP, lengths_B = jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32)
    text = generator._on_device.lower(params, tokens_BP, lengths_B, 8, jnp.int32(-1)).as_text()
    # The prefill's scan over the layers, the decode loop and, inside it, its scan over the layers: one program.
    assert text.count("stablehlo.while") == 3


def test_decode_logits_equal_the_full_forward_pass(one_device):
    layout, params, prompt = one_device
    model = nnx.merge(layout.graphdef, params)
    tokens_1S = jnp.asarray([prompt], jnp.int32)
    full_SV = model(tokens_1S)[0]
    cache = model.empty_cache(1, PROMPT_LENGTH, jnp.float32)
    logits_1V, cache = model.decode(tokens_1S[:, :8], cache, 0)  # prefill half the prompt
    np.testing.assert_allclose(logits_1V[0], full_SV[7], atol=1e-5)
    for position in range(8, PROMPT_LENGTH):
        logits_1V, cache = model.decode(tokens_1S[:, position:position + 1], cache, position)
        np.testing.assert_allclose(logits_1V[0], full_SV[position], atol=1e-5)


def test_the_cache_is_sharded_like_attention_and_changes_nothing_under_tensor_parallelism():
    layout, params, prompt = _setup(tensor=2)
    prompts = [prompt, prompt[:9]]
    tokens = Generator(layout, Sampling(max_tokens=20))(params, prompts, None)
    assert tokens == Generator(layout, Sampling(max_tokens=20, kv_cache=False))(params, prompts, None)
    model = nnx.merge(layout.graphdef, params)
    cache = model.empty_cache(1, PROMPT_LENGTH + 1, jnp.float32)
    _, cache = _jitted_decode(layout)(params, cache, jnp.asarray([prompt], jnp.int32), 0)
    for leaf_LBTKE in cache:  # (layers, batch, length, kv_heads, head_dim): kv heads over `tensor`
        assert leaf_LBTKE.sharding.spec == PartitionSpec(None, None, None, "tensor")


def test_generation_layout_keeps_the_recipes_tensor_degree_and_folds_the_rest():
    recipe = load_recipe(ROOT / "recipes" / "fsdp_tp.toml")
    meta = {"recipe": {"name": recipe.name, "tables": {k: dict(v) for k, v in recipe.raw.items()}}}
    layout = generation_layout(meta, jax.devices())
    assert dict(layout.mesh.shape) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 4, "sequence": 1, "pipeline": 1}
    assert dict(generation_layout(meta, jax.devices()[:2]).mesh.shape)["tensor"] == 1  # too few devices: one


def test_a_model_whose_layers_cannot_decode_generates_by_recomputing_with_one_warning():
    """A model without the cache protocol (here the MoE model) still generates: the tokens of --no-kv-cache."""
    recipe = load_recipe(ROOT / "recipes" / "moe_ep.toml", ["mesh.expert=1", "mesh.data=1"])
    layout = build_layout(recipe, jax.devices()[:1])
    params = init_params(layout, seed=0)
    with pytest.warns(UserWarning, match="no `decode` for a KV cache"):
        cached = Generator(layout, Sampling(max_tokens=3))(params, [[1, 2, 3]], None)
    assert cached == Generator(layout, Sampling(max_tokens=3, kv_cache=False))(params, [[1, 2, 3]], None)


def test_a_text_run_needs_no_tokenizer_file():
    """A `data.source = "text"` run's tokens are the UTF-8 bytes: they encode and decode without a tokenizer file."""
    meta = {"recipe": {"tables": {"data": {"source": "text", "path": "corpus.txt"}}}}
    tokenizer, eos_id = load_tokenizer(meta, None)
    ids = tokenizer.encode("héllo ✓")
    assert ids == list("héllo ✓".encode()) and eos_id is None
    assert tokenizer.decode(ids) == "héllo ✓"
    assert tokenizer.decode([104, 300, 105]) == "h\ufffdi"  # an id past the bytes reads as the replacement character
    with_eos = {"recipe": {"tables": {"data": {"source": "text", "path": "corpus.txt", "eos_id": 10}}}}
    assert load_tokenizer(with_eos, None)[1] == 10
    with pytest.raises(ShardkitError, match=r"--tokenizer: the run trained on random token ids \(data.source = "
                                            r"'synthetic'\), which no tokenizer wrote; pass --tokenizer"):
        load_tokenizer({"recipe": {"tables": {}}}, None)


@pytest.mark.slow
def test_generate_from_a_text_run_without_a_tokenizer(tmp_path):
    """Two steps on a UTF-8 file read as bytes, then `generate` with no tokenizer file: text in, text out."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("héllo wörld, the quick brown fox. " * 40, encoding="utf-8")
    run = tmp_path / "run"
    overrides = ["data.source=text", f"data.path={corpus}", "train.steps=2", "train.seq_len=16", "train.global_batch=2",
                 "model.layers=1"]
    train(load_recipe(ROOT / "recipes" / "single.toml", overrides), run, log=io.StringIO(), devices=jax.devices()[:1])
    completions = generate(run, ["héllo", "a"], Sampling(max_tokens=8))
    assert len(completions) == 2 and all(isinstance(text, str) for text in completions)
    assert generate(run, ["héllo"], Sampling(max_tokens=8)) == completions[:1]  # the same alone as in the batch
