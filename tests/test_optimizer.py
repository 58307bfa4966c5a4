"""Optimizer defaults per model preset: published settings where a preset has them, the width rule elsewhere, the
tiny presets' tuned settings kept, and whatever a recipe or `--set` gives winning over all of them."""

from __future__ import annotations

import tomllib

import pytest

from shardkit.cli import main
from shardkit.models.llama import LLAMA3_8B_OPTIMIZER
from shardkit.optimizer import BASE_SETTINGS, learning_rate_schedule, optimizer_settings, width_rule_lr
from shardkit.recipe import recipe_from_tables
from shardkit.registry import load_model_class, model_config
from tests.helpers import recipe


def settings_of(r):
    """`optimizer_settings` of a recipe whose model is resolved here, as `build_layout` resolves it."""
    model_class = load_model_class(r.model.name)
    return optimizer_settings(r, model_class, model_config(model_class, r.model))


def _shown_optimizer(capsys, *args: str) -> dict:
    assert main(["show", *args]) == 0
    return tomllib.loads(capsys.readouterr().out)["optimizer"]


def test_show_prints_the_8b_presets_published_rate(capsys):
    shown = _shown_optimizer(capsys, "fsdp", "--set", "model.preset=8b")
    assert shown["lr"] == 3e-4 and shown == LLAMA3_8B_OPTIMIZER
    assert _shown_optimizer(capsys, "fsdp", "--set", "model.preset=llama3.1-8b") == LLAMA3_8B_OPTIMIZER


def test_a_set_value_wins_over_the_preset(capsys):
    shown = _shown_optimizer(capsys, "fsdp", "--set", "model.preset=8b", "--set", "optimizer.lr=1e-3")
    assert shown == {**LLAMA3_8B_OPTIMIZER, "lr": 1e-3}


def test_a_recipe_table_wins_over_the_preset():
    tables = {"model": {"preset": "8b"}, "optimizer": {"warmup": 10, "b2": 0.99}}
    settings = settings_of(recipe_from_tables(tables))
    assert (settings.lr, settings.warmup, settings.b2, settings.eps) == (3e-4, 10, 0.99, 1e-5)


@pytest.mark.parametrize("name, preset", [("fsdp", "tiny"), ("moe_ep", "moe-tiny"), ("moe_ep", "tiny")])
def test_the_tiny_presets_keep_their_tuned_settings(name, preset):
    settings = settings_of(recipe(name, f"model.preset={preset}"))
    assert settings.given() == BASE_SETTINGS and settings.lr == 3e-3 and settings.warmup == 5


def test_the_mlp_model_keeps_the_tuned_settings_too():
    assert settings_of(recipe("single", "model.name=mlp")).given() == BASE_SETTINGS


@pytest.mark.parametrize("preset, width", [("1b", 2048), ("llama3.2-3b", 3072), ("small", 768)])
def test_presets_without_published_settings_follow_the_width_rule(preset, width):
    settings = settings_of(recipe("fsdp", f"model.preset={preset}"))
    assert settings.lr == pytest.approx(0.5 / width) == width_rule_lr(width)
    assert {**settings.given(), "lr": BASE_SETTINGS["lr"]} == BASE_SETTINGS


def test_the_width_rule_follows_a_width_override_and_stays_within_the_gpt3_table():
    assert settings_of(recipe("fsdp", "model.embed=4096", "model.mlp=64")).lr == pytest.approx(0.5 / 4096)
    gpt3 = {768: 6e-4, 1024: 3e-4, 1536: 2.5e-4, 2048: 2e-4, 2560: 1.6e-4, 4096: 1.2e-4, 5140: 1e-4, 12288: 0.6e-4}
    assert all(1 / 1.7 < width_rule_lr(width) / lr < 1.7 for width, lr in gpt3.items())


def test_the_schedule_peaks_at_the_resolved_rate():
    settings = settings_of(recipe("fsdp", "model.preset=1b", "optimizer.warmup=2", "train.steps=10"))
    schedule = learning_rate_schedule(settings, 10)
    assert float(schedule(2)) == pytest.approx(0.5 / 2048)
    assert float(schedule(10)) == pytest.approx(0.1 * 0.5 / 2048)
