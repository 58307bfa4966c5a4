"""Fit before the first step, out-of-memory as one line, JAX's GPU memory fraction and the recipe's XLA flags."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import jax
import pytest

from shardkit.analysis.compiled import fit
from shardkit.analysis.predicted.targets import cuda_plugin_available, parse_target, target_devices
from shardkit.cli import main, set_memory_fraction
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.run.loop import CompiledStep, compile_line, train
from shardkit.units import parse_size
from shardkit.xla_flags import GPU_DEFAULTS, compiler_options, parse_flags
from tests.helpers import ROOT, recipe

OOM_TEXT = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 51539607552 bytes."
needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason='needs the jax[cuda12] plugin: pip install "jax[cuda12]==0.10.2"')


def _tiny():
    return recipe("single", "model.layers=1", "train.seq_len=16", "train.global_batch=2", "train.steps=1")


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.strip().splitlines() if line.startswith("shardkit:")]
    assert len(lines) == 1, stderr
    return lines[0]


# ---- the check before the first step -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_step_that_does_not_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """SHARDKIT_DEVICE_MEMORY stands in for a GPU's bytes_limit on CPU devices, which report none. `train`, which
    the CLI calls, on one of this process's devices: the refusal is a one-line error (the CLI prints any as
    `shardkit: error: FIELD: ...`, test_faults.py's refusals check that printing)."""
    out = tmp_path / "run"
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, "1MiB")
    with pytest.raises(ShardkitError) as refused:
        train(recipe("single", "model.layers=1", "train.seq_len=16", "train.steps=1"), out,
              devices=jax.devices()[:1], log=io.StringIO())
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("memory: the compiled step needs") and "can allocate 0.00 GiB" in line
    for knob in ("train.remat=full", "train.grad_accum=2", "mesh.fsdp", "train.global_batch"):
        assert knob in line, line
    assert not out.exists(), "a refused run must leave no run directory"


@pytest.mark.slow
def test_a_step_that_fits_trains(tmp_path, monkeypatch):
    monkeypatch.setenv(fit.MEMORY_LIMIT_ENV, "64GiB")
    log = io.StringIO()
    result = train(_tiny(), tmp_path / "run", devices=jax.devices()[:1], log=log)
    assert len(result.records) == 1 and (tmp_path / "run" / "metrics.jsonl").exists()
    line = next(line for line in log.getvalue().splitlines() if line.startswith("compiled the step"))
    pattern = r"compiled the step in \d+\.\d s on 1 device: \d+\.\d [KM]iB of 64\.0 GiB per device"
    assert re.fullmatch(pattern, line), line


@pytest.mark.parametrize("devices, peak, limit, expected", [
    (1, 34.6 * 2**30, 125.8 * 2**30, "compiled the step in 13.7 s on 1 device: 34.6 GiB of 125.8 GiB per device"),
    (8, 3 * 2**20 // 2, None, "compiled the step in 13.7 s on 8 devices: 1.5 MiB per device"),
    (2, None, None, "compiled the step in 13.7 s on 2 devices"),
])
def test_the_compile_line_names_the_peak_and_the_limit(devices, peak, limit, expected):
    """A CPU device reports no limit: the peak alone; a backend without memory analysis: the time alone."""
    peak = None if peak is None else int(peak)
    assert compile_line(CompiledStep(None, 13.71, peak, None if limit is None else int(limit)), devices) == expected


def test_check_fit_compares_the_peak_with_the_limit():
    single = recipe("single", "train.remat=selective", "train.global_batch=4")
    fit.check_fit(10 * fit.GIB, None, single, "cpu:0")  # no limit: no check
    fit.check_fit(10 * fit.GIB, 10 * fit.GIB, single, "cpu:0")
    with pytest.raises(fit.OutOfMemory, match=r"needs 10\.00 GiB per device but cuda:0 \(H100\) can allocate 9\.00"):
        fit.check_fit(10 * fit.GIB, 9 * fit.GIB, single, "cuda:0 (H100)")


def test_remedies_suggest_only_knobs_that_apply():
    only_fsdp = fit.remedies(recipe("single", "train.remat=full", "train.global_batch=1"))
    assert only_fsdp == "mesh.fsdp over more devices (now 1)"
    text = fit.remedies(recipe("single", "train.remat=none", "train.global_batch=4", "train.grad_accum=2"))
    assert text == ("train.remat=full (now none), train.grad_accum=4 (now 2), mesh.fsdp over more devices (now 1) "
                    "or a smaller train.global_batch (now 4)")


@pytest.mark.parametrize("text, expected", [("1000", 1000), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29),
                                            ("40g", 40 * 2**30), ("5GB", 5 * 10**9), ("1M", 2**20)])
def test_sizes_read_si_as_decimal_and_iec_or_bare_letters_as_binary(text, expected):
    assert parse_size(text, "SHARDKIT_DEVICE_MEMORY") == expected


@pytest.mark.parametrize("text", ["", "-1GiB", "0", "12 parsecs", "GiB"])
def test_parse_bytes_refuses_nonsense(text):
    with pytest.raises(ShardkitError, match=fit.MEMORY_LIMIT_ENV):
        parse_size(text, "SHARDKIT_DEVICE_MEMORY")


# ---- out of memory at run time --------------------------------------------------------------------------------------
def _raise_oom(*args, **kwargs):
    raise jax.errors.JaxRuntimeError(OOM_TEXT)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["shardkit.run.loop._run_step", "shardkit.step.StepBuilder.init_state"])
def test_out_of_memory_at_run_time_is_one_line(where, tmp_path, monkeypatch):
    """The step (or the state's initialisation) raising XLA's RESOURCE_EXHAUSTED, as a GPU does when an allocation
    fails, becomes `OutOfMemory` (a ShardkitError: the CLI prints it as one line, exit 2) with the size and knobs."""
    monkeypatch.setattr(where, _raise_oom)
    with pytest.raises(fit.OutOfMemory) as caught:
        train(_tiny(), tmp_path / "run", devices=jax.devices()[:1], log=io.StringIO())
    text = str(caught.value)
    assert text.startswith("memory: the device could not allocate 48.00 GiB at run time (XLA: RESOURCE_EXHAUSTED)")
    assert "train.remat=full" in text and "\n" not in text


def test_the_cli_prints_an_out_of_memory_as_one_line(monkeypatch, capsys):
    """Outside the training loop (plan, hlo) the CLI itself turns RESOURCE_EXHAUSTED into the line, exit 2."""
    monkeypatch.setattr("shardkit.cli._plan", _raise_oom)
    assert main(["plan", "recipes/single.toml"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("shardkit: error: memory: the device could not allocate 48.00 GiB")


def test_other_runtime_errors_are_not_swallowed(monkeypatch):
    def fail(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"), fit.out_of_memory_as_error(_tiny()):
        fail()
    monkeypatch.setattr("shardkit.cli._plan", fail)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        main(["plan", "recipes/single.toml"])


# ---- JAX's GPU memory fraction --------------------------------------------------------------------------------------
def test_memory_fraction_default_and_user_override():
    environ: dict[str, str] = {}
    assert set_memory_fraction(environ) == fit.DEFAULT_MEM_FRACTION == environ[fit.MEM_FRACTION_ENV]
    mine = {fit.MEM_FRACTION_ENV: "0.5"}
    assert set_memory_fraction(mine) == "0.5" and fit.memory_fraction(mine) == 0.5
    assert fit.memory_fraction({}) == fit.JAX_DEFAULT_MEM_FRACTION


@pytest.mark.slow
def test_cli_sets_the_memory_fraction_before_jax_starts():
    probe = "import os, sys; sys.argv = ['shardkit', 'plan', 'recipes/single.toml', '--devices', '1', '--no-compile']"
    code = probe + "; from shardkit.cli import main; main(); print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"
    environ = {key: value for key, value in os.environ.items() if key != fit.MEM_FRACTION_ENV}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env=environ)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == fit.DEFAULT_MEM_FRACTION  # a user's own value: the test above


# ---- XLA flags ------------------------------------------------------------------------------------------------------
def test_flags_are_parsed_and_checked():
    assert parse_flags(["--xla_gpu_enable_latency_hiding_scheduler=true", "xla_gpu_graph_min_graph_size=8"]) == {
        "xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_graph_min_graph_size": "8"}
    with pytest.raises(ShardkitError, match=r"xla\.flags: '--gpu_thing' is not an XLA flag"):
        recipe("single", "xla.flags=['--gpu_thing']")
    with pytest.raises(ShardkitError, match="given twice"):
        parse_flags(["--xla_a=1", "--xla_a=2"])


def test_flags_apply_to_gpu_compiles_only():
    cpu = build_layout(recipe("dp"))
    assert compiler_options(cpu.recipe, cpu.mesh) is None


@pytest.fixture(scope="module")
def h100():
    return target_devices(parse_target("h100x1"))


@needs_plugin
def test_gpu_compile_gets_the_defaults_and_the_recipe_wins(h100):
    mine = recipe("single", "xla.flags=['--xla_gpu_enable_command_buffer=FUSION', '--xla_gpu_graph_min_graph_size=8']")
    layout = build_layout(mine, h100)
    # The recipe's value replaces the default's; the other defaults stay; the recipe's own flag is added.
    assert compiler_options(layout.recipe, layout.mesh) == {**GPU_DEFAULTS, "xla_gpu_enable_command_buffer": "FUSION",
                                                            "xla_gpu_graph_min_graph_size": "8"}
    plain = build_layout(recipe("single"), h100)
    assert compiler_options(plain.recipe, plain.mesh) == dict(GPU_DEFAULTS)
    bare = build_layout(recipe("single", "xla.gpu_defaults=false"), h100)
    assert compiler_options(bare.recipe, bare.mesh) is None


@pytest.mark.slow
@needs_plugin
def test_xla_refusing_a_flag_names_the_recipe_field(tmp_path, capsys):
    """XLA checks every name and value at compile time (here for an H100 without a GPU): one line naming xla.flags."""
    assert main(["hlo", "recipes/single.toml", "--target", "h100x1", "--out", str(tmp_path / "hlo"),
                 "--set", "xla.flags=['--xla_gpu_enable_command_buffer=BOGUS']"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("shardkit: error: xla.flags: XLA refused a flag") and "BOGUS" in line
    assert not (tmp_path / "hlo").exists()


@needs_plugin
def test_plan_says_whether_the_step_fits_on_one_gpu(capsys, monkeypatch):
    monkeypatch.delenv(fit.MEM_FRACTION_ENV, raising=False)
    assert main(["plan", "recipes/single.toml", "--target", "h100x1", "--no-compile"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("fits on h100x1: ") and "of 71.28 GiB per device (analytic peak" in line, line
    monkeypatch.setenv(fit.MEM_FRACTION_ENV, "0.75")  # JAX's own default: the 59.4 GiB bytes_limit
    assert main(["plan", "recipes/single.toml", "--target", "h100x1", "--no-compile", "--set", "model.preset=8b",
                 "--set", "train.seq_len=4096", "--set", "train.global_batch=8"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("does not fit on h100x1: ") and "of 59.40 GiB per device" in line, line


@pytest.mark.slow
@needs_plugin
def test_bool_flags_reach_xla_as_booleans(capsys):
    """`true`/`false` in XLA_FLAGS form are passed as booleans, the only form XLA's per-compile parser accepts."""
    flags = "xla.flags=['--xla_gpu_enable_latency_hiding_scheduler=true', '--xla_gpu_enable_triton_gemm=false']"
    assert main(["plan", "recipes/single.toml", "--target", "h100x1", "--set", flags]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("fits on h100x1: ")
