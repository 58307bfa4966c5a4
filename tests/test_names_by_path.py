"""A Flax model as its authors wrote it (tests/own_models/lab_lm.py: their own `data` FSDP annotations, flat-initialised
three-name kernels, unnamed LayerNorms, a 128-entry position table), unpatched: names by path in the recipe
(`[rules.paths]`), unnamed parameters replicated and listed, an axis that splits nothing named, and generation and
training held within the model's positions. Refusals end in one line, exit 2, before anything compiles."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import types

import jax
import numpy as np
import pytest

from shardkit.analysis.predicted.estimate import communication_estimate
from shardkit.cli import main
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout, init_params
from shardkit.run.generate import Generator, Sampling
from shardkit.run.loop import _raise_if_not_finite
from shardkit.testing import sharding_specs
from tests.equivalence import assert_traces_close, trace
from tests.helpers import ROOT, recipe

LAB = "model.name=tests.own_models.lab_lm:LabLM"
DATA_FSDP = "rules.params.data=fsdp"
# Heads and MLP widths named by path, the model's own `data` names left to the rest.
PATHS = ("rules.paths={ 'lm/blocks_\\d+/CausalAttn_0/(query|key|value)/kernel' = ['embed', 'heads', ''], "
         "'lm/blocks_\\d+/CausalAttn_0/out/kernel' = ['heads', '', 'embed'], "
         "'lm/blocks_\\d+/Mlp_0/up/kernel' = ['embed', 'mlp'], 'lm/blocks_\\d+/Mlp_0/down/kernel' = ['mlp', 'embed'] }")
BLOCK = "lm/blocks_0/"
SHORT = ("train.steps=2",)


def _sets(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def _plan(capsys, name: str, *overrides: str) -> dict:
    assert main(["plan", name, "--no-compile", "--json", *_sets(LAB, *overrides)]) == 0
    return json.loads(capsys.readouterr().out)


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_the_unpatched_model_builds_its_unnamed_norms_replicated():
    """Failures 1 and 2 of the model as written: unnamed LayerNorms, and Flax's own constraint on the flat-initialised
    three-name kernels under the forward's mesh (the layout traces the forward)."""
    layout = build_layout(recipe("fsdp", LAB, DATA_FSDP))
    specs = sharding_specs(layout)
    assert specs[BLOCK + "LayerNorm_0/scale"] == [None]
    assert specs[BLOCK + "CausalAttn_0/query/kernel"] == ["fsdp", None, None]
    assert specs["lm/pos_embed"] == [None, "fsdp"]
    assert layout.name_sources[BLOCK + "LayerNorm_0/scale"] == "none"
    assert layout.name_sources["lm/head/kernel"] == "model"


def test_fsdp_that_splits_nothing_says_so_and_names_the_rule(capsys):
    """The authors' `data` is a mesh axis of size 1 under fsdp: nothing splits, plan says so, and the analytic column
    predicts no gather; `rules.params.data=fsdp` splits it."""
    idle = _plan(capsys, "fsdp")
    assert idle["totals"]["param_bytes_per_device"] == idle["totals"]["param_bytes"]
    assert idle["warnings"] == ["warning: mesh.fsdp=8 splits no parameter: the model's parameters carry none of the "
                                "names the rules map to `fsdp` (embed); the model names mesh axis `data`, of size 1 "
                                "in this recipe: map it with --set rules.params.data=fsdp"]
    kinds = {(item["what"], item["kind"]) for item in idle["estimate"]["communication"]}
    assert ("gradients", "all-reduce") in kinds and not any(kind == "all-gather" for _, kind in kinds)
    split = _plan(capsys, "fsdp", DATA_FSDP)
    assert split["warnings"] == []
    assert split["totals"]["param_bytes_per_device"] < 0.2 * split["totals"]["param_bytes"]
    assert any(item["kind"] == "all-gather" for item in split["estimate"]["communication"])
    unnamed = split["unnamed"]
    assert unnamed["count"] == 10 and unnamed["bytes"] == 10 * 64 * 4
    assert {row["names_from"] for row in split["params"]} == {"model", "none"}


def test_path_rules_make_tensor_split_the_weights(capsys):
    unnamed_heads = _plan(capsys, "fsdp_tp", DATA_FSDP)
    assert [line.split(":")[0] for line in unnamed_heads["warnings"]] == ["warning"]
    assert "mesh.tensor=4 splits no parameter" in unnamed_heads["warnings"][0]
    assert "[rules.paths] 'lm/blocks_\\d+/Mlp_\\d+/down/kernel' = [\"mlp\", \"embed\"]" in unnamed_heads["warnings"][0]
    named = _plan(capsys, "fsdp_tp", DATA_FSDP, PATHS)
    assert named["warnings"] == []
    assert named["totals"]["param_bytes_per_device"] < unnamed_heads["totals"]["param_bytes_per_device"]
    rows = {row["path"]: row for row in named["params"]}
    assert rows[BLOCK + "CausalAttn_0/key/kernel"]["spec"] == ["fsdp", "tensor", None]
    assert rows[BLOCK + "CausalAttn_0/key/kernel"]["names_from"].startswith("path rule 'lm/blocks_")
    assert rows[BLOCK + "Mlp_0/down/kernel"]["spec"] == ["tensor", "fsdp"]
    assert rows["lm/embed/embedding"]["names_from"] == "model"


def test_plan_text_shows_each_parameters_name_source(capsys):
    assert main(["plan", "fsdp_tp", "--no-compile", *_sets(LAB, DATA_FSDP, PATHS)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\npath +shape +logical +from +spec +per device", "\n" + out)
    assert re.search(r"\nlm/blocks_0/Mlp_0/up/kernel +\(64,256\) +embed,mlp +rule 3 +\(fsdp,tensor\)", out)
    assert "names from: the model 3, path rule 1 'lm/blocks_\\d+/CausalAttn_0/(query|key|value)/kernel' 6," in out
    assert "none 10 (unnamed: replicated, 2.50 KiB)" in out


def test_plan_page_shows_each_parameters_name_source(capsys, tmp_path):
    page = tmp_path / "plan.html"
    assert main(["plan", "fsdp_tp", "--no-compile", "--html", str(page), *_sets(LAB, DATA_FSDP, PATHS)]) == 0
    html = page.read_text()
    assert "<th>names from</th>" in html and "10 parameters named by neither the model nor a path rule" in html
    assert "<td class=\"\">path rule 3: lm/blocks_\\d+/Mlp_0/up/kernel</td>" in html


def test_the_first_matching_path_rule_wins_over_the_model():
    first = "rules.paths={ 'lm/head/kernel' = ['embed', 'vocab'], 'lm/(head|embed)/.*' = ['', 'embed'] }"
    layout = build_layout(recipe("fsdp_tp", LAB, DATA_FSDP, first))
    specs = sharding_specs(layout)
    assert specs["lm/head/kernel"] == ["fsdp", "tensor"]
    assert specs["lm/embed/embedding"] == [None, "fsdp"]
    assert layout.name_sources["lm/embed/embedding"] == "path rule 'lm/(head|embed)/.*'"


@pytest.mark.parametrize("overrides, fragment", [
    (("rules.paths={ 'lm/blocks_0/attention/kernel' = ['embed'] }",),
     "rules.paths.'lm/blocks_0/attention/kernel': matches no parameter (matched in full against paths such as "),
    (("rules.paths={ 'lm/pos_embed' = ['', 'embed', ''] }",),
     "rules.paths.'lm/pos_embed': gives 3 names ['', 'embed', ''] to lm/pos_embed, which has shape (128, 64); give at "
     "most one per dimension"),
    (("rules.paths={ 'lm/(' = ['embed'] }",), "rules.paths.'lm/(': is not a regular expression"),
    (("rules.paths={ 'lm/pos_embed' = 'embed' }",), "rules.paths.'lm/pos_embed': must be a list of logical names"),
    (("rules.unnamed=refuse",), "model: parameter lm/blocks_0/LayerNorm_0/bias (64,) has no logical axis names; "
                                "annotate it the Flax way"),
    (("rules.unnamed=keep",), "rules.unnamed: must be one of ['replicate', 'refuse'], got 'keep'"),
    (("model.name=tests.own_models.lab_lm:OverNamedLM",),
     "model: parameter lm/table has shape (256, 64) but 3 logical names ('data', None, None), which cannot fit it; "
     "name it in the recipe instead: [rules.paths] 'lm/table' = [\"\", \"\"]"),
    (("train.seq_len=256",), "train.seq_len: 256 is past the model's position limit, Config.max_len = 128"),
])
def test_what_cannot_apply_ends_in_one_line(capsys, overrides, fragment):
    assert fragment in _one_line_error(capsys, ["plan", "fsdp", "--no-compile", *_sets(LAB, *overrides)])


def test_a_path_rule_overrides_names_that_do_not_fit():
    layout = build_layout(recipe("fsdp", "model.name=tests.own_models.lab_lm:OverNamedLM",
                                 "rules.paths={ 'lm/table' = ['vocab', 'embed'] }"))
    assert sharding_specs(layout)["lm/table"] == [None, "fsdp"]


def test_train_past_the_position_table_is_refused_before_compiling(capsys, tmp_path):
    err = _one_line_error(capsys, ["train", "fsdp", "--out", str(tmp_path / "run"), *_sets(LAB, "train.seq_len=256")])
    assert "use train.seq_len <= 128" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.fixture(scope="module")
def one_device():
    layout = build_layout(recipe("single", LAB), jax.devices()[:1])
    return layout, init_params(layout, 0)


def test_generation_stops_at_the_position_limit_and_later_tokens_change_no_earlier_one(one_device):
    """Past the 128-entry table the model gives NaN, which causal attention would carry back into earlier positions:
    generation stops at the table's end, saying so, and 10 tokens are the first 10 of 125."""
    layout, params = one_device
    prompt = [[84, 104, 101]]
    with pytest.warns(UserWarning, match=r"stopping after 125 new tokens of the 200 asked, at the model's position "
                                         r"limit \(Config.max_len = 128\)"):
        long = Generator(layout, Sampling(max_tokens=200, kv_cache=False))(params, prompt, None)[0]
    short = Generator(layout, Sampling(max_tokens=10, kv_cache=False))(params, prompt, None)[0]
    assert len(long) == 125 and long[:10] == short


def test_non_finite_logits_stop_generation_in_one_line(one_device):
    layout, params = one_device
    broken = jax.tree.map(lambda x: x * np.float32(np.nan), params)
    with pytest.raises(ShardkitError, match="generate: the model's logits are not finite"):
        Generator(layout, Sampling(max_tokens=4, kv_cache=False))(broken, [[1, 2, 3]], None)


def test_the_analytic_gather_follows_the_specs_used():
    idle = communication_estimate(build_layout(recipe("fsdp", LAB)))
    assert [(item.kind, item.axes) for item in idle] == [("all-reduce", ("fsdp",))]
    idle_tensor = communication_estimate(build_layout(recipe("fsdp_tp", LAB, DATA_FSDP)))
    assert idle_tensor and not any("tensor" in item.axes for item in idle_tensor)
    split = communication_estimate(build_layout(recipe("fsdp_tp", LAB, DATA_FSDP, PATHS)))
    assert any("tensor" in item.axes for item in split)


def test_a_non_finite_loss_names_the_position_table_among_its_causes():
    builder = types.SimpleNamespace(policy=types.SimpleNamespace(loss_scaling=False))
    with pytest.raises(ShardkitError, match="check that train.seq_len is within the model's position table"):
        _raise_if_not_finite({"step": 1, "loss": float("nan"), "grad_norm": 1.0}, builder)



@pytest.fixture(scope="module")
def reference():
    return trace(recipe("single", LAB, *SHORT), steps=3, devices=jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.parametrize("layout, overrides", [("fsdp_tp", (DATA_FSDP,)), ("fsdp_tp", (DATA_FSDP, PATHS))],
                         ids=["fsdp_tp", "paths"])
def test_the_lab_model_trains_like_one_device(reference, layout, overrides):
    """fp32, rel 1e-5: three steps' losses, the evaluation loss and the first step's gradients.

    fsdp_tp without the path rules holds what fsdp alone would: the model's own names (`data` on fsdp) sharding its
    parameters and batch, with the tensor axis left idle beside them."""
    assert_traces_close(trace(recipe(layout, LAB, *overrides, *SHORT), steps=3), reference, rtol=1e-5)


EXAMPLE = ROOT / "examples" / "train_unnamed_model.py"


@pytest.fixture(scope="module")
def example():
    """The example imported as a module (its model class importable by `module:Class`, as a script's is)."""
    spec = importlib.util.spec_from_file_location("train_unnamed_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_unnamed_model"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["train_unnamed_model"]


def test_a_model_that_names_nothing_is_replicated_and_warned_of(example, capsys):
    assert main(["plan", "fsdp", "--no-compile", "--json", "--set", "model.name=train_unnamed_model:UnnamedModel"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["unnamed"]["count"] == 10 and plan["unnamed"]["share"] == 1.0
    assert plan["totals"]["param_bytes_per_device"] == plan["totals"]["param_bytes"]
    fsdp, unnamed = plan["warnings"]
    assert fsdp.startswith("warning: mesh.fsdp=8 splits no parameter") and "[rules.paths] 'blocks/\\d+/" in fsdp
    assert unnamed.startswith("warning: 10 parameters have no logical names and are replicated on every device "
                              "(100.0% of the parameters), the largest blocks/0/down/kernel (256, 64); name it by "
                              "path, e.g. [rules.paths] 'blocks/\\d+/down/kernel' = [\"\", \"embed\"]")


@pytest.mark.slow
def test_the_unnamed_example_trains_under_fsdp_tp_by_path_rules(example, capsys):
    specs = sharding_specs(build_layout(example.recipe()))
    assert specs["blocks/0/up/kernel"] == ["fsdp", "tensor"] and specs["blocks/0/norm/scale"] == [None]
    losses = example.main(steps=12)
    assert losses[-1] < 0.5 * losses[0]
    assert "step 11" in capsys.readouterr().out


def test_linen_boxes_patch_still_fits_flax():
    """shardkit/linen_boxes.py swaps the `unbox` of Flax's two partitioning boxes (Flax has no switch for parameter
    constraints alone while a mesh is in context): if Flax renames a box, its `unbox` or the parameter, or stops
    constraining under the abstract mesh, this fails here rather than as a mis-laid or refused Linen model."""
    import inspect

    from flax.core import meta

    from shardkit.linen_boxes import BOX_CLASSES, unconstrained_boxes

    for cls in BOX_CLASSES:
        assert "unbox" in cls.__dict__, f"{cls.__qualname__} no longer defines unbox: update shardkit/linen_boxes.py"
        assert "apply_constraint" in inspect.signature(cls.__dict__["unbox"]).parameters, cls
    mesh = jax.make_mesh((1,), ("data",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])  # as shardkit's
    boxes = [cls(np.ones((2, 3), np.float32), ("data", None)) for cls in BOX_CLASSES]
    boxes[1] = boxes[1].replace(rules=(("data", "data"),))

    def constraints(box) -> int:
        """The sharding constraints `box.unbox()` applies, traced."""
        return str(jax.make_jaxpr(lambda: box.unbox())()).count("sharding_constraint")

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert meta.global_mesh_defined(), "Flax no longer reads the abstract mesh: linen_boxes' note needs review"
        assert [constraints(box) for box in boxes] == [1, 1], "Flax's boxes no longer constrain: is the patch needed?"
        with unconstrained_boxes(), unconstrained_boxes():  # re-entrant
            assert [constraints(box) for box in boxes] == [0, 0]
        assert [constraints(box) for box in boxes] == [1, 1]  # Flax's own unbox restored
