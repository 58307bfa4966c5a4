"""Bad input of every kind: exit code 2, one line naming the field and what is valid, no traceback, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardkit.cli import main
from tests.helpers import ROOT

BAD_RECIPES = {
    "toml_syntax": ("[train\nsteps = 3\n", [], "recipe", "not valid TOML"),
    "unknown_key": ("[train]\nstepz = 3\n", [], "train.stepz", "valid keys are"),
    "unknown_section": ("[trian]\nsteps = 3\n", [], "trian", "valid sections are"),
    "wrong_type": ("", ["train.seq_len=abc"], "train.seq_len", "must be int"),
    "mesh_not_covering": ("[mesh]\ndata = 3\n", [], "mesh", "8 are present"),
    "too_many_devices": ("[mesh]\ndata = 16\n", [], "mesh", "cover 16 devices but 8 are present"),
    "two_wildcards": ("[mesh]\ndata = -1\nfsdp = -1\n", [], "mesh.fsdp", "only one axis may be -1"),
    "unknown_axis": ("[rules.params]\nembed = \"fsdpp\"\n", [], "rules.params.embed", "unknown mesh axis 'fsdpp'"),
    "axis_twice": ("[mesh]\ntensor = 2\ndata = -1\n[rules.params]\nembed = \"tensor\"\n", [], "blocks/",
                   "used twice in one spec"),
    "indivisible": ("[mesh]\nfsdp = -1\n", ["model.embed=60"], "blocks/", "not divisible by 8"),
    "unknown_logical": ("[mesh]\nfsdp = -1\n[rules.params]\nembed = []\n", ["model.name=tests.toy_models:OddModel"],
                        "w_DX", "has no rule"),
    "kv_heads_over_tensor": ("[mesh]\ntensor = 8\n", [], "kv_heads", "replicate the KV heads"),
    "unknown_model": ("", ["model.name=gpt9"], "model.name", "unknown model"),
    "unknown_preset": ("", ["model.preset=huge"], "model.preset", "valid presets are"),
    "unknown_dim": ("", ["model.depth=3"], "model.depth", "valid fields are"),
    "bad_precision": ("", ["precision.policy=fp4"], "precision.policy", "use a preset"),
    "bad_remat": ("", ["train.remat=some"], "train.remat", "must be one of"),
    "offload_on_cpu": ("", ["train.remat=offload"], "train.remat", "needs a GPU or TPU"),
    "accum_not_dividing": ("", ["train.grad_accum=3"], "train.grad_accum", "not divisible"),
    "bad_set_syntax": ("", ["trainsteps"], "--set", "expected section.key=value"),
    "misspelled_shorthand": ("[mesh]\nfsdp = -1\n", ["rules.fsdp=embd"], "rules.fsdp", "unknown logical name 'embd'"),
    "misspelled_raw_rule": ("[mesh]\nfsdp = -1\n", ["rules.params.embd=fsdp"], "rules.params.embd",
                            "unknown logical name"),
    "missing_data_file": ("", ["data.source=text", "data.path=/nonexistent/corpus.txt"], "data.path", "no file at"),
    "text_needs_bytes": ("", ["data.source=text", "data.path=README.md", "model.vocab=128"], "data.source",
                         "vocab >= 256"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECIPES))
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    text, overrides, field, fragment = BAD_RECIPES[case]
    recipe = tmp_path / "bad.toml"
    recipe.write_text(text or "[mesh]\ndata = -1\n")
    out = tmp_path / "run"
    argv = ["train", str(recipe), "--out", str(out), "--steps", "2"]
    for override in overrides:
        argv += ["--set", override]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("shardkit: error: ") and field in err and fragment in err, err
    assert not out.exists(), "nothing may be written on bad input"


def test_missing_recipe_file(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope.toml")]) == 2
    err = capsys.readouterr().err
    assert "recipe: no recipe file" in err and "recipes/fsdp.toml" in err


def test_unknown_flag(capsys):
    assert main(["plan", "recipes/dp.toml", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def _run(*args: str) -> subprocess.CompletedProcess:
    """The command in a fresh process whose environment says nothing about devices (the test process's does)."""
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    command = [sys.executable, "-m", "shardkit", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_subprocess_bad_input_has_no_traceback():
    """The real command: exit 2 and a single line, whatever JAX and orbax print while starting."""
    result = _run("plan", "recipes/fsdp.toml", "--devices", "8", "--set", "model.embed=60")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("shardkit: error: blocks/")


@pytest.mark.slow
def test_devices_flag_takes_effect_before_jax_starts():
    """--devices 4 gives a 4-device mesh even though nothing else configured JAX (the plan's mesh and devices need no
    compile; the compiled plan is held in-process by test_plan_html and test_predict)."""
    result = _run("plan", "recipes/fsdp.toml", "--devices", "4", "--json", "--no-compile")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["mesh"]["fsdp"] == 4 and len(plan["devices"]) == 4


def test_without_an_nvidia_driver_the_command_line_keeps_jax_on_the_cpu(monkeypatch):
    """With the jax[cuda12] plugin installed on a machine without NVIDIA's driver, JAX would log a cuInit traceback
    before falling back to the CPU; the command line chooses the CPU first, unless the user chose the platforms."""
    from shardkit import cli

    monkeypatch.setattr(cli.os.path, "exists", lambda path: False)
    environ = {}
    cli._cpu_without_nvidia_driver(environ)
    assert environ == {"JAX_PLATFORMS": "cpu"}
    mine = {"JAX_PLATFORMS": "cuda"}
    cli._cpu_without_nvidia_driver(mine)
    assert mine == {"JAX_PLATFORMS": "cuda"}
    monkeypatch.setattr(cli.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    with_driver = {}
    cli._cpu_without_nvidia_driver(with_driver)
    assert with_driver == {}


def test_a_write_that_fails_after_the_checks_is_one_line(capsys):
    """/dev/full passes the pre-checks (it can be opened for writing) and fails on the write itself, with ENOSPC."""
    assert main(["plan", "recipes/fsdp.toml", "--no-compile", "--html", "/dev/full"]) == 2
    err = capsys.readouterr().err
    assert err == "shardkit: error: /dev/full: No space left on device\n"


def test_recipes_prints_each_description_whole(capsys):
    from shardkit.recipe import builtin_recipes

    assert main(["recipes"]) == 0
    listed = " ".join(capsys.readouterr().out.split())  # as wrapped to the terminal's width
    cp_ending = ("attention runs context-parallel (zigzag causal load balancing), and FSDP over the rest of the "
                 "devices "
                 "shards the parameters.")
    assert cp_ending in listed and "the tiny model's 4 layers, one per stage." in listed
    assert all(f"{name} " in listed for name in builtin_recipes())


def test_an_argument_error_points_at_the_right_help(capsys):
    assert main(["recipes", "extra"]) == 2
    assert capsys.readouterr().err.endswith("unrecognized arguments: extra (see shardkit --help)\n")
    assert main(["data", "prepare", "--bogus"]) == 2
    assert capsys.readouterr().err.endswith("(see shardkit data prepare --help)\n")
