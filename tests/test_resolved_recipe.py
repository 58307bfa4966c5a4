"""The resolved recipe (recipe + overrides + defaults) and shardkit's one TOML writer: it reads back as the same
recipe, `shardkit show` prints it, the copy in a run directory reruns the run, a resume on other model or data
names every differing key, and recipe numbers refuse NaN and infinity."""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import shlex
import subprocess
import sys
import tomllib

import jax
import pytest

from shardkit import registry
from shardkit.cli import main
from shardkit.errors import ShardkitError
from shardkit.optimizer import with_optimizer_settings
from shardkit.recipe import RUN_RECIPE, load_recipe, recipe_from_tables, resolved_tables, resolved_toml, to_toml
from shardkit.registry import load_model_class, model_config, model_dims
from shardkit.rules import build_rules
from shardkit.run.checkpoint import check_compatible, model_meta
from shardkit.run.loop import train
from tests.helpers import RECIPES, ROOT, recipe

SHIPPED = sorted(path.stem for path in RECIPES.glob("*.toml"))


def _config(r):
    return model_config(load_model_class(r.model.name), r.model)


@pytest.mark.parametrize("name", SHIPPED)
def test_resolved_recipe_reads_back_as_the_same_recipe(name):
    original = recipe(name, "optimizer.lr=1e-4", "rules.params.embed=fsdp")
    tables = tomllib.loads(to_toml(resolved_tables(original)))
    assert recipe_from_tables(tables, original.name) == original
    assert set(tables["train"]) == {field.name for field in dataclasses.fields(original.train)}  # defaults written


@pytest.mark.parametrize("overrides", [(), ("data.packing=documents", "data.eos_id=3")])
def test_optional_settings_read_back_given_or_not(overrides):
    """An optional setting left out (None: TOML has no null) stays out, and reads back as None; given, it is kept."""
    original = recipe("fsdp", *overrides)
    assert recipe_from_tables(tomllib.loads(to_toml(resolved_tables(original))), original.name) == original


@pytest.mark.parametrize("name", SHIPPED)
def test_resolved_toml_spells_out_the_model_config(name):
    original = recipe(name, "model.layers=2")
    written = recipe_from_tables(tomllib.loads(resolved_toml(original, model_dims(_config(original)))), original.name)
    assert _config(written) == _config(original)
    assert dict(written.model.dims)["layers"] == 2 and "embed" in dict(written.model.dims)


@pytest.mark.parametrize("value", ["a\U0001F600b", 'quote " and \\ backslash', "line\nbreak\ttab\x7f", "é"])
def test_the_writer_keeps_any_string_and_key(value):
    """What the two hand-written writers got wrong: characters outside the BMP, dotted keys left unquoted."""
    tables = {"model": {"name": value}, "rules": {"params": {"a.b": ["fsdp"], "x y": "tensor", value: []}}}
    assert tomllib.loads(to_toml(tables, ["a comment", f"a comment holding {value}"])) == tables  # escaped in comments


def test_the_writer_refuses_what_toml_cannot_hold():
    with pytest.raises(ShardkitError, match="--write: cannot be written as TOML"):
        to_toml({"train": {"steps": None}}, field="--write")


def test_show_prints_the_resolved_recipe(capsys):
    assert main(["show", "recipes/tp.toml", "--set", "train.steps=3", "--set", "optimizer.lr=0.01"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# shardkit show recipes/tp.toml --set train.steps=3 --set optimizer.lr=0.01")
    shown = recipe_from_tables(tomllib.loads(text), "tp")
    given = recipe("tp", "train.steps=3", "optimizer.lr=0.01")
    expected = with_optimizer_settings(given, load_model_class(given.model.name), _config(given))
    assert expected.optimizer.lr == 0.01 and expected.optimizer.warmup == 5  # given, and the preset's default
    assert dataclasses.replace(shown, model=expected.model) == expected and _config(shown) == _config(expected)


def test_show_prints_the_rule_tables_the_shorthands_expand_to(capsys):
    assert main(["show", "tp_sp"]) == 0
    text = capsys.readouterr().out
    shown = text[text.index("# [rules.params]"):].splitlines()
    expanded = tomllib.loads("\n".join(line.removeprefix("# ") for line in shown))
    rules = build_rules(recipe("tp_sp").rules)
    assert expanded["rules"] == {"params": {k: list(v) for k, v in rules.params.items()},
                                 "activations": {k: list(v) for k, v in rules.activations.items()}}
    assert expanded["rules"]["activations"]["residual_sequence"] == ["sequence", "tensor"]  # the shorthand's work
    assert tomllib.loads(text)["rules"] == {"tensor": ["heads", "kv_heads", "mlp", "vocab", "residual_sequence"],
                                            "zero": 0, "unnamed": "replicate"}  # the comments are shown, not read back


def test_show_keeps_a_newline_of_a_set_value_inside_its_header_comment(capsys):
    assert main(["show", "fsdp", "--set", "data.path='''a\nb'''"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# shardkit show fsdp --set data.path='''a\\nb''': the resolved recipe")
    assert tomllib.loads(text)["data"]["path"] == "a\nb"


@pytest.mark.parametrize("override", ["optimizer.lr=nan", "optimizer.lr=inf", "train.dropout=-inf", "optimizer.eps=nan",
                                      "precision.loss_scale_init=inf", "model.rope_theta=nan", "train.steps=inf"])
def test_numbers_refuse_nan_and_infinity(override, capsys):
    key = override.split("=")[0]
    with pytest.raises(ShardkitError, match="must be a finite number") as caught:
        recipe("fsdp", override)
    assert caught.value.field == key
    assert main(["show", "recipes/fsdp.toml", "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"shardkit: error: {key}: must be a finite number, got ")


# ---- resume: the model and the data must match, the layout may change ----------------------------------------------
def _meta(*overrides):
    r = recipe("fsdp", *overrides)
    return model_meta(r, _config(r))


def test_a_resume_on_another_model_names_every_differing_key():
    with pytest.raises(ShardkitError) as caught:
        check_compatible(_meta(), _meta("model.layers=2", "model.embed=32", "model.heads=4", "model.kv_heads=2"),
                         "run", 4)
    text = str(caught.value)
    assert caught.value.field == "model"
    for key, saved in (("layers", 4), ("embed", 64), ("heads", 8), ("kv_heads", 4)):
        assert f"model.{key}={saved}" in text and f"--set model.{key}={saved}" in text


def test_a_resume_on_other_data_names_the_keys_but_an_import_takes_any_data(tmp_path):
    data = tmp_path / "tokens.bin"
    other = ("data.source=bin", f"data.path={data}", "data.dtype=uint32")
    with pytest.raises(ShardkitError) as caught:
        check_compatible(_meta(), _meta(*other), "run", 4)
    text = str(caught.value)
    assert caught.value.field == "data"
    assert all(f"data.{key}=" in text for key in ("source", "path", "dtype")), text
    assert check_compatible(_meta(), _meta(*other), "run", 0) is None  # step 0: an import has seen no data


def test_checkpoints_from_before_the_data_key_are_checked_from_their_tables():
    saved = _meta("data.source=text", "data.path=corpus.txt")
    del saved["data"]
    with pytest.raises(ShardkitError, match=r"data\.source='text' \(this recipe: 'synthetic'\)"):
        check_compatible(saved, _meta(), "run", 4)


def test_a_layout_change_still_resumes():
    assert check_compatible(_meta(), _meta("mesh.fsdp=2", "mesh.tensor=4", "rules.zero=1"), "run", 4) is None


# ---- the resolved recipe in a run directory reruns the run -------------------------------------------------------
def _count_model_lookups(monkeypatch) -> collections.Counter:
    """Calls of the registry's model lookups from here on, wherever a shardkit module bound them."""
    counts = collections.Counter()
    for name in ("load_model_class", "model_config"):
        original = getattr(registry, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("shardkit") and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    return counts


@pytest.mark.slow
def test_the_run_directory_recipe_reruns_to_the_same_losses(tmp_path, monkeypatch):
    """The run also resolves its model class and config once, in the layout: the optimizer's defaults and the written
    recipe take both from there."""
    overrides = ("train.steps=3", "train.global_batch=4", "train.seq_len=16", "optimizer.lr=0.01", "train.seed=7",
                 "model.layers=2")
    first, second, third = tmp_path / "first run", tmp_path / "second", tmp_path / "third's"  # quoting needed
    one = jax.devices()[:1]
    lookups = _count_model_lookups(monkeypatch)
    losses = [r["loss"] for r in train(recipe("single", *overrides), first, log=io.StringIO(), devices=one).records]
    assert lookups == {"load_model_class": 1, "model_config": 1}
    command = (first / RUN_RECIPE).read_text().splitlines()[0]
    assert command == f"# shardkit train {shlex.quote(str(first / RUN_RECIPE))} --out NEW_DIR --devices 1"
    rerun = train(load_recipe(first / RUN_RECIPE), second, log=io.StringIO(), devices=one).records
    assert [r["loss"] for r in rerun] == losses
    assert [json.loads(line)["loss"] for line in (second / "metrics.jsonl").read_text().splitlines()] == losses
    # The written command itself, in a fresh process (which gets 1 fake device from its --devices 1 alone):
    argv = shlex.split(command.removeprefix("# ").replace("NEW_DIR", shlex.quote(str(third))))
    subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, check=True, capture_output=True, timeout=300)
    assert [json.loads(line)["loss"] for line in (third / "metrics.jsonl").read_text().splitlines()] == losses
