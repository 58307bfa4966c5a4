"""Flax models as their authors wrote them (tests/own_models): an NNX model with mesh-axis-named specs, enums in its
config and no `vocab` field, and a Linen model through `nnx.bridge` with two names on three-dimensional kernels and
an input shift. They plan, train like one device and resume across layouts through the CLI; what cannot work ends in
one line, exit 2, before anything compiles."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from shardkit.api import Trainer
from shardkit.cli import main
from shardkit.errors import ShardkitError
from shardkit.hf.export import saved_config
from shardkit.layout import build_layout, init_params
from shardkit.registry import config_json
from shardkit.run.checkpoint import check_compatible, model_meta
from shardkit.step import build_step
from shardkit.testing import sharding_specs
from tests.equivalence import assert_traces_close, trace
from tests.helpers import recipe
from tests.own_models.nnx_lm import AttentionType, ShardingConfig, Transformer, TransformerConfig

NNX = ("model.name=tests.own_models.nnx_lm:Transformer", "rules.params.tp=tensor")
STACKED = ("model.name=tests.own_models.nnx_lm:StackedTransformer", "rules.params.tp=tensor")
LINEN = ("model.name=tests.own_models.linen_lm:LinenLM", "rules.params.kv=tensor", "rules.params.joined_kv=tensor")
SHORT = ("train.steps=2",)


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _sets(overrides) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def test_mesh_axis_names_shard_along_their_axes():
    specs = sharding_specs(build_layout(recipe("fsdp_tp", *NNX)))
    assert specs["embedder/embedding"] == ["tensor", "fsdp"]
    assert specs["layers/0/attn/q_einsum/kernel"] == ["fsdp", "tensor", None]
    assert specs["layers/0/attn/query_norm/scale"] == [None]


def test_fewer_names_than_dimensions_name_the_leading_ones():
    """Linen's DenseGeneral: ('embed', 'kv') on a (embed, heads, head_dim) kernel, as JAX reads it."""
    specs = sharding_specs(build_layout(recipe("fsdp_tp", *LINEN)))
    block = "decoder/encoderdecoderblock_0/SelfAttention_0/"
    assert specs[block + "query/kernel"] == ["fsdp", "tensor", None]
    assert specs[block + "out/kernel"] == ["tensor", "fsdp", None]


def test_vocab_from_the_logits_and_layers_from_the_stack():
    layout = build_layout(recipe("fsdp", *STACKED))
    assert layout.vocab == 256 and layout.layers == 4 and not layout.inputs_shifted
    assert build_layout(recipe("fsdp", *LINEN)).inputs_shifted


def test_any_dataclass_config_is_saved_as_comparable_json():
    config = TransformerConfig()
    saved = json.loads(json.dumps(config_json(config)))
    assert saved == config_json(TransformerConfig())
    assert saved["attention_types"][0] == {"enum": "tests.own_models.nnx_lm:AttentionType.GLOBAL"}
    assert saved["dtype"] == {"dtype": "float32"}
    assert saved["shd_config"]["emb_vd"] == {"PartitionSpec": ["tp", "fsdp"]}
    other = TransformerConfig(shd_config=ShardingConfig(emb_vd=PartitionSpec("fsdp", "tp")))
    assert config_json(other) != saved


@pytest.mark.parametrize("argv, fragment", [
    (["plan", "fsdp", "--no-compile", "--set", NNX[0]],
     ("embedder/embedding: logical axis 'tp' (shape (256, 64), axes ('tp', 'fsdp')) has no rule in rules.params; map "
      "it to mesh axes with --set rules.params.tp=tensor (or a list, or [] to leave it whole)")),
    (["plan", "fsdp", "--no-compile", "--set", LINEN[0]],
     "has no rule in rules.params; map it to mesh axes with --set rules.params.kv=tensor"),
    (["plan", "fsdp", "--no-compile", *_sets(NNX[1:]), "--set", "model.name=tests.own_models.nnx_lm:CachedTransformer"],
     ("model.name: tests.own_models.nnx_lm:CachedTransformer.__call__ takes (tokens_BT, positions_BT, cache, "
      "attn_mask_BTS), but shardkit calls it as __call__(tokens_BS) -> logits_BSV")),
    (["plan", "fsdp", "--no-compile", *_sets(NNX[1:]),
      "--set", "model.name=tests.own_models.nnx_lm:ExplicitShardingTransformer"],
     "model: ExplicitShardingTransformer passes a PartitionSpec to out_sharding="),
    (["plan", "fsdp", "--no-compile", *_sets(NNX[1:]),
      "--set", "model.name=tests.own_models.nnx_lm:UnstackedLayersForgotten"],
     ("model: parameter layers/attn/attn_vec_einsum/kernel has shape (4, 8, 8, 64) but 3 logical names, one short "
      "like every parameter under 'layers': stacked with nnx.vmap/nnx.scan?")),
    (["plan", "pp", "--no-compile", *_sets(NNX)], "mesh.pipeline: Transformer has no layer stack a pipeline can split"),
    (["plan", "fsdp", "--no-compile", *_sets(NNX), "--target", "h100x8"],
     "--target: TransformerConfig has no `layers`, `embed`, `mlp` field"),
    (["suggest", "fsdp", "--target", "h100x8", "--no-compile", *_sets(NNX)],
     "model: suggest ranks layouts with the analytic model, which reads the dimensions ['layers', 'embed', 'mlp']"),
])
def test_what_cannot_work_ends_in_one_line(capsys, argv, fragment):
    assert fragment in _one_line_error(capsys, argv)


def test_plan_shows_the_names_and_warns_of_an_idle_tensor_axis(capsys):
    overrides = (LINEN[0], "rules.params.kv=[]", "rules.params.joined_kv=[]")
    assert main(["plan", "fsdp_tp", "--no-compile", *_sets(overrides)]) == 0
    out = capsys.readouterr().out
    assert ("model names: embed -> fsdp (default), joined_kv -> whole (recipe), kv -> whole (recipe), mlp -> tensor "
            "(default), vocab -> tensor (default)") in out
    assert "warning: mesh.tensor=4 splits none of the model's attention weights" in out
    assert main(["plan", "fsdp_tp", "--no-compile", *_sets(LINEN)]) == 0
    assert "splits none" not in capsys.readouterr().out


def test_plan_of_a_stacked_model_shows_its_schedule(capsys, tmp_path):
    """No analytic figures for a config of its own names, but the schedule (its layer count read off the stack) and
    its Gantt chart; a page of figures is refused in one line, writing nothing."""
    stacked = (*_sets(NNX), "--set", "model.name=tests.own_models.nnx_lm:StackedTransformer")
    assert main(["plan", "pp", "--no-compile", *stacked, "--gantt", str(tmp_path / "g.svg")]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 4 stages x 1 layers" in out and "unknown (the model's config has no `embed` width)" in out
    assert (tmp_path / "g.svg").exists()
    page = tmp_path / "plan.html"
    assert "--html: TransformerConfig has no" in _one_line_error(capsys, ["plan", "pp", *stacked, "--html", str(page)])
    assert not page.exists()


def test_own_attention_under_context_parallelism_is_named(capsys):
    assert main(["plan", "cp", "--no-compile", *_sets(NNX)]) == 0
    assert "warning: the recipe splits the sequence over ['sequence'], but Transformer computes its own attention" in (
        capsys.readouterr().out)


@pytest.mark.slow
def test_a_model_that_shifts_its_inputs_gets_them_as_targets():
    """LinenLM's logits[t] predict tokens[t]: the loss takes the inputs as targets (`inputs_shifted = True`). One
    device: the targets the loss picks do not depend on the layout (the layouts train like one device below)."""
    layout = build_layout(recipe("single", *LINEN), jax.devices()[:1])
    builder = build_step(layout)
    params = init_params(layout, 0)
    tokens_BS1 = jax.random.randint(jax.random.key(1), (16, 65), 0, 256)
    inputs_BS = tokens_BS1[:, :-1]
    logits_BSV = layout.apply(params, inputs_BS)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, inputs_BS).mean()
    np.testing.assert_allclose(jax.jit(builder.loss)(params, tokens_BS1), expected, rtol=1e-6)


def test_a_config_that_differs_refuses_the_resume_in_one_line(tmp_path):
    saved = model_meta(recipe("fsdp", *NNX), TransformerConfig())
    current = model_meta(recipe("fsdp", *NNX), TransformerConfig(attention_types=(AttentionType.GLOBAL,)))
    assert check_compatible(saved, json.loads(json.dumps(saved)), tmp_path, 2) is None
    with pytest.raises(ShardkitError, match="model.attention_types: checkpoint in .* was trained with "
                       "model.attention_types=") as err:
        check_compatible(json.loads(json.dumps(saved)), current, tmp_path, 2)
    # Readable values, and no --set for a value a --set cannot give (tagged JSON is no override).
    message = str(err.value)
    assert "(AttentionType.GLOBAL, AttentionType.LOCAL_SLIDING) (this recipe: (AttentionType.GLOBAL,))" in message
    assert "--set model." not in message and "(model.attention_types cannot be given with --set)" in message
    # Another preset: the checkpoint's preset is the override that resumes it, beside the scalars that differ.
    other = model_meta(recipe("fsdp", *NNX, "model.preset=other"), TransformerConfig(attention_types=(), head_dim=4))
    with pytest.raises(ShardkitError, match=r'resume with --set model.preset="tiny" --set model.head_dim=8 or'):
        check_compatible(json.loads(json.dumps(saved)), other, tmp_path, 2)
    # A value the checkpoint left unset is to be left unset (no `--set data.eos_id=null`).
    eos = model_meta(recipe("fsdp", *NNX, "data.eos_id=1"), TransformerConfig())
    with pytest.raises(ShardkitError, match=r"data.eos_id=None \(this recipe: 1\); resume with data.eos_id unset"):
        check_compatible(json.loads(json.dumps(saved)), eos, tmp_path, 2)


def test_a_saved_config_of_any_field_types_is_read_back():
    """generate and export rebuild the config from the run's recipe (enums, nested specs), checked against the
    checkpoint's; a preset changed since is refused in one line naming the fields."""
    meta = json.loads(json.dumps(model_meta(recipe("fsdp", *NNX), TransformerConfig())))
    assert saved_config(Transformer, meta) == TransformerConfig()
    meta["config"]["head_dim"] = 4
    with pytest.raises(ShardkitError, match=r"no longer builds the config .* \(fields \['head_dim'\] differ\)"):
        saved_config(Transformer, meta)


def test_shard_refuses_rows_that_do_not_split():
    trainer = Trainer.build(recipe("fsdp", *NNX))
    with pytest.raises(ShardkitError, match="has 12 rows, which do not split over the 8 devices"):
        trainer.shard(np.zeros((12, 65), np.int32))


MODELS = {"nnx": NNX, "linen": LINEN, "stacked": STACKED}


class _References(dict):
    """One-device traces of each model, each traced when a test first asks for it."""

    def __missing__(self, name):
        self[name] = trace(recipe("single", *MODELS[name], *SHORT), steps=3, devices=jax.devices()[:1])
        return self[name]


@pytest.fixture(scope="module")
def references():
    return _References()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nnx", "linen"])
def test_own_models_train_like_one_device(references, name):
    """fp32, rel 1e-5: three steps' losses, the evaluation loss and the first step's gradients (read back from the
    step: no compile of their own).

    fsdp_tp holds what fsdp and tp would alone: the models' own `fsdp` specs and names gathered and reduce-scattered
    over the fsdp axis (2 devices: the same collectives as over 8, on the same dimensions), and the same tensor rules
    over 4 devices (the models' own `tp` specs and names on `tensor`). fsdp over 8 alone trains through the CLI in
    `test_resume_from_fsdp_onto_fsdp_tp_through_the_cli`."""
    assert_traces_close(trace(recipe("fsdp_tp", *MODELS[name], *SHORT), steps=3), references[name], rtol=1e-5)


@pytest.mark.slow
def test_stacked_model_pipelines_like_one_device(references):
    """Its layers mask scores with jnp.where on a constant mask, under the recipe's loss: three steps' losses, the
    evaluation loss and the first step's gradients. Circular (2 stages x 2 repeats of one layer a chunk) runs the
    GPipe tick loop (shardkit/pipeline/gpipe.py) with the stack cut into chunks and re-laid out, so it holds what
    plain GPipe (repeats 1) would for this model; GPipe itself is held to one device on the Llama by
    tests/test_pipeline.py (`test_pipeline_equals_one_device[gpipe]`)."""
    schedule = ("mesh.pipeline=2", "pipeline.microbatches=4", "pipeline.schedule=circular", "pipeline.repeats=2")
    assert_traces_close(trace(recipe("pp", *STACKED, *SHORT, *schedule), steps=3), references["stacked"], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("model", [NNX, LINEN], ids=["nnx", "linen"])
def test_resume_from_fsdp_onto_fsdp_tp_through_the_cli(tmp_path, capsys, model):
    out = str(tmp_path / "run")
    assert main(["train", "fsdp", "--steps", "2", "--out", out, *_sets(model)]) == 0
    assert main(["train", "fsdp_tp", "--steps", "3", "--out", out, *_sets(model)]) == 0
    assert "resuming from the checkpoint at step 2" in capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3]
