"""Hugging Face Llama checkpoints: import gives transformers' logits, export -> import is bit-exact, bad configs are
refused, and an imported run trains identically under two layouts.

The fixtures in tests/data/hf/ were made by tests/make_hf_fixtures.py (torch + transformers, run once); these tests
need only numpy and safetensors."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from shardkit.cli import main
from shardkit.errors import ShardkitError
from shardkit.hf.config import llama_config_fields
from shardkit.hf.convert import ORIGINAL_CONFIG, import_hf
from shardkit.hf.export import load_run_params
from shardkit.hf.tensors import SafetensorsDir, read_block, tensor_maps, to_hf_matrix
from shardkit.layout import abstract_model
from shardkit.recipe import RUN_RECIPE, load_recipe
from shardkit.registry import load_model_class
from shardkit.run.loop import train
from tests.helpers import recipe

DATA = Path(__file__).resolve().parent / "data" / "hf"
FIXTURES = ("untied", "tied")
LOGITS_TOLERANCE = 1e-5  # fp32; transformers (torch, eager attention) and XLA sum in different orders
LAYOUT_TOLERANCE = 1e-5
Llama = load_model_class("llama")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Each fixture imported under the fsdp recipe (8 devices): {name: (run dir, Imported)}."""
    runs = {}
    for name in FIXTURES:
        out = tmp_path_factory.mktemp(name)
        runs[name] = (out, import_hf(DATA / name, out, recipe("fsdp")))
    return runs


def forward(meta: dict, params: dict, tokens: np.ndarray, positions=None) -> np.ndarray:
    config = Llama.Config(**meta["config"])
    graphdef, _, _ = abstract_model(Llama, config)
    model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
    return np.asarray(model(jnp.asarray(tokens), positions))


@pytest.mark.parametrize("name", FIXTURES)
def test_imported_logits_equal_transformers(imported, name):
    run_dir, _ = imported[name]
    step, meta, params = load_run_params(run_dir)
    assert step == 0 and meta["config"]["tie_embeddings"] == (name == "tied")
    assert meta["config"]["rope_type"] == "llama3"
    expected = np.load(DATA / name / "logits.npy")
    logits = forward(meta, params, np.load(DATA / name / "tokens.npy"))
    np.testing.assert_allclose(logits, expected, rtol=0, atol=LOGITS_TOLERANCE)


@pytest.mark.parametrize("name", FIXTURES)
def test_export_then_import_is_bit_exact(imported, name, tmp_path):
    run_dir, _ = imported[name]
    exported = tmp_path / "hf"
    # 30 KB shards: the export is split, with an index, like the untied original
    assert main(["export", str(run_dir), "--format", "hf", "--to", str(exported), "--shard-size", "30KB"]) == 0
    assert (exported / "model.safetensors.index.json").is_file()
    original, written = SafetensorsDir(DATA / name), SafetensorsDir(exported)
    assert written.names() == original.names()
    for tensor in original.names():
        np.testing.assert_array_equal(written.read(tensor), original.read(tensor))
    again = tmp_path / "again"
    import_hf(exported, again, recipe("tp", "mesh.tensor=2"))
    _, _, first = load_run_params(run_dir)
    _, _, second = load_run_params(again)
    jax.tree.map(np.testing.assert_array_equal, first, second)


@pytest.mark.parametrize("name", FIXTURES)
def test_exported_config_equals_the_original(imported, name, tmp_path):
    run_dir, _ = imported[name]
    original = json.loads((DATA / name / "config.json").read_text())
    main(["export", str(run_dir), "--format", "hf", "--to", str(tmp_path / "kept")])
    assert json.loads((tmp_path / "kept" / "config.json").read_text()) == original
    # Without the import's copy of config.json (a run trained from scratch) the model's own fields still match.
    bare = tmp_path / "bare_run"
    shutil.copytree(run_dir, bare)
    (bare / ORIGINAL_CONFIG).unlink()
    main(["export", str(bare), "--format", "hf", "--to", str(tmp_path / "bare")])
    rebuilt = json.loads((tmp_path / "bare" / "config.json").read_text())
    assert llama_config_fields(rebuilt) == llama_config_fields(original)


@pytest.mark.slow
def test_import_then_train_fsdp_and_tp_equal(imported, tmp_path):
    """Fine-tuning: two steps from the same imported checkpoint under FSDP and under tensor parallelism."""
    run_dir, result = imported["untied"]
    model = [f"model.{key}={value}" for key, value in result.model_table.items()]
    losses = {}
    for layout, extra in (("fsdp", ()), ("tp", ("mesh.tensor=2",))):
        out = tmp_path / layout
        shutil.copytree(run_dir, out)
        records = train(recipe(layout, "train.steps=2", *model, *extra), out, log=io.StringIO()).records
        losses[layout] = [record["loss"] for record in records]
    assert len(losses["fsdp"]) == 2
    np.testing.assert_allclose(losses["tp"], losses["fsdp"], rtol=0, atol=LAYOUT_TOLERANCE)


@pytest.mark.slow
def test_run_recipe_resumes_the_import(imported, tmp_path):
    run_dir, _ = imported["tied"]
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    assert main(["train", str(out / RUN_RECIPE), "--out", str(out), "--steps", "1"]) == 0
    assert load_recipe(out / RUN_RECIPE).model.preset == "tiny"
    assert load_run_params(out)[0] == 1


def _broken_copy(tmp_path: Path, change) -> Path:
    broken = tmp_path / "broken"
    shutil.copytree(DATA / "tied", broken)
    config = json.loads((broken / "config.json").read_text())
    change(config)
    (broken / "config.json").write_text(json.dumps(config))
    return broken


@pytest.mark.parametrize("change, field", [
    (lambda c: c.update(attention_bias=True), "config.json:attention_bias"),
    (lambda c: c.update(mlp_bias=True), "config.json:mlp_bias"),
    (lambda c: c.update(hidden_act="gelu"), "config.json:hidden_act"),
    (lambda c: c["rope_scaling"].update(rope_type="yarn"), "config.json:rope_scaling.rope_type"),
    (lambda c: c.update(model_type="mistral"), "config.json:model_type"),
    (lambda c: c.update(num_hidden_layers=3), "model.layers.2.input_layernorm.weight"),
])
def test_import_refuses_what_it_cannot_represent(tmp_path, capsys, change, field):
    broken = _broken_copy(tmp_path, change)
    out = tmp_path / "out"
    assert main(["import-hf", str(broken), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardkit: error: {field}: ") and "\n" not in err
    assert not out.exists()


def test_import_refuses_an_extra_tensor(tmp_path):
    from safetensors.numpy import save_file

    broken = _broken_copy(tmp_path, lambda c: None)
    original = SafetensorsDir(broken)
    tensors = {name: original.read(name) for name in original.names()}
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ShardkitError, match="q_proj.bias: has no counterpart"):
        import_hf(broken, tmp_path / "out")


def test_rotary_positions_are_relative(imported):
    """Shifting every position leaves the logits unchanged (rotary encodes offsets); other positions change them."""
    run_dir, _ = imported["untied"]
    _, meta, params = load_run_params(run_dir)
    tokens = np.load(DATA / "untied" / "tokens.npy")
    base = forward(meta, params, tokens)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    np.testing.assert_allclose(forward(meta, params, tokens, positions + 100), base, atol=1e-4)
    assert np.abs(forward(meta, params, tokens, positions * 2) - base).max() > 1e-2


def test_tied_head_starts_near_uniform():
    """No extra scale on the tied head: the init keeps the first logits O(1), the loss near ln(vocab)."""
    import dataclasses

    config = dataclasses.replace(Llama.PRESETS["tiny"], tie_embeddings=True)
    model = Llama(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, config.vocab)
    logits = model(tokens[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    assert abs(float(loss) - np.log(config.vocab)) < 1.0
    assert 0.5 < float(logits.std()) < 2.0


def test_bfloat16_tensors_are_read(tmp_path):
    """Most Llama checkpoints are stored in bf16: the file is written here byte by byte (no library), and the
    safetensors library reads back a rectangle of it as numpy bfloat16."""
    import ml_dtypes

    values = (np.arange(12, dtype=np.float32).reshape(3, 4) / 7).astype(ml_dtypes.bfloat16)
    header = json.dumps({"x": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, values.nbytes]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + values.tobytes())
    tensors = SafetensorsDir(tmp_path)
    assert tensors.shape("x") == (3, 4) and tensors.read("x").dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(tensors.tensor("x")[1:3, 2:], values[1:3, 2:])


@pytest.mark.parametrize("content, field", [
    (b"not a safetensors file at all", "model.safetensors"),
    (b"\x08\x00\x00\x00\x00\x00\x00\x00{\"x\": 1}", "model.safetensors"),
])
def test_a_broken_safetensors_file_is_refused_in_one_line(tmp_path, capsys, content, field):
    broken = _broken_copy(tmp_path, lambda c: None)
    (broken / "model.safetensors").write_bytes(content)
    assert main(["import-hf", str(broken), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardkit: error: {field}: is not a safetensors file") and "\n" not in err


def test_integer_tensors_are_refused(tmp_path):
    from safetensors.numpy import save_file

    save_file({"x": np.zeros((2, 2), np.int32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ShardkitError, match="model.safetensors:x: dtype I32 is not one of"):
        SafetensorsDir(tmp_path).tensor("x")


@pytest.mark.parametrize("name", sorted(path.stem for path in
                                       (Path(__file__).parent.parent / "recipes").glob("*.toml")))
def test_run_recipe_toml_reads_back_as_the_same_recipe(name, tmp_path):
    """The recipe.toml an import writes, for every shipped recipe (nested rule tables included)."""
    from shardkit.recipe import to_toml

    original = recipe(name, "model.norm_eps=1e-05", "model.rope_type=llama3")
    (tmp_path / "r.toml").write_text(to_toml(original.raw))
    assert load_recipe(tmp_path / "r.toml") == dataclasses.replace(original, name="r")


@pytest.mark.parametrize("tensor_map", tensor_maps(tie_embeddings=False), ids=lambda m: m.path)
def test_read_block_is_the_block_of_any_slicing(tensor_map):
    """Every axis cut (head_dim included, which no shipped recipe does): the rectangle read equals the block."""
    shapes = {1: (12,), 2: (12, 10), 3: (12, 4, 6)}
    rank = len(tensor_map.rows) + len(tensor_map.cols)
    shape = shapes[rank] if rank != 3 or tensor_map.rows != (2,) else (4, 6, 12)
    full = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    matrix = to_hf_matrix(full, tensor_map)
    index = tuple(slice(size // 4, size // 4 + size // 2) for size in shape)
    np.testing.assert_array_equal(read_block(matrix, tensor_map, shape, index), full[index])
