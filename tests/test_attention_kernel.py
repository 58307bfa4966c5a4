"""The one kernel choice (shardkit/attention/kernel.py) against JAX itself, and what happens without cuDNN.

- The table of what cuDNN accepts is held against JAX's own lowering of `jax.nn.dot_product_attention(...,
  implementation="cudnn")` for the h100 target (deviceless, on this CPU): head_dim 64/128/192/256, fp32/bf16/fp16,
  causal and not. A disagreement either way fails: the table must say exactly what JAX lowers.
- JAX's private cuDNN module is reached in one place; if JAX moves it, the first test here fails loudly.
- The cuDNN library that cannot load (a broken `nvidia-cudnn-cu12` wheel, "cuDNN not found") is simulated by making
  JAX's own version probe raise as it then does: `auto` warns once and compiles XLA's attention, `cudnn` exits 2 with
  one line. The commands run through the CLI's entry in this process, with the warning filters a fresh process starts
  with.
"""

from __future__ import annotations

import json
import re
import subprocess
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from shardkit.analysis.predicted.targets import cuda_plugin_available, parse_target, target_devices
from shardkit.attention.kernel import cudnn_module, cudnn_rejects, cudnn_version, platform_of
from shardkit.cli import main
from tests.helpers import RECIPES

needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason='needs the jax[cuda12] plugin (Linux x86_64): pip install "jax[cuda12]"')


def test_jax_private_cudnn_module_still_has_what_shardkit_binds():
    module = cudnn_module()
    for name in ("_dot_product_attention_fwd_p_wrapper", "_dot_product_attention_bwd_p_wrapper", "MaskType",
                 "AttentionLayout", "check_is_flash_attention"):
        assert hasattr(module, name), \
            f"jax._src.cudnn.fused_attention_stablehlo lost {name}: update attention/kernel.py"


@needs_plugin
def test_cudnn_version_probe_reads_the_installed_library():
    assert cudnn_version() is not None and cudnn_version() >= 90000


def _jax_lowers_cudnn(device, dtype, head_dim: int, causal: bool) -> bool:
    q = jax.ShapeDtypeStruct((1, 128, 4, head_dim), dtype, sharding=SingleDeviceSharding(device))
    attend = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))
    try:
        attend.lower(q, q, q)
    except (NotImplementedError, ValueError, RuntimeError):
        return False
    return True


@needs_plugin
@pytest.mark.slow
def test_the_cudnn_table_says_what_jax_lowers_on_the_h100_target():
    device = target_devices(parse_target("h100x1"))[0]
    platform = platform_of(device)
    disagreements = []
    for head_dim in (64, 128, 192, 256):
        for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
            for causal in (True, False):
                table = cudnn_rejects(platform, dtype, head_dim, causal) is None
                jax_says = _jax_lowers_cudnn(device, dtype, head_dim, causal)
                if table != jax_says:
                    disagreements.append((head_dim, jnp.dtype(dtype).name, causal, table, jax_says))
    assert not disagreements, f"(head_dim, dtype, causal, table accepts, JAX lowers): {disagreements}"


BF16_TINY = ("--set", "precision.policy=bf16", "--set", "model.layers=2", "--set", "train.global_batch=2")


def _without_cudnn(monkeypatch, capsys, *args: str) -> subprocess.CompletedProcess:
    """`shardkit ARGS` in this process with JAX's cuDNN probe failing as it does when libcudnn.so.9 cannot be loaded.
    The warning filters start as a fresh process's do (every warning shown once from its line, none seen yet), so the
    command prints the warnings a process of its own would."""
    from jax._src.lib import cuda_versions

    def missing():
        raise RuntimeError("cuDNN not found")

    monkeypatch.setattr(cuda_versions, "cudnn_get_version", missing)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.resetwarnings()  # no filters: Python's default action, once per line (and a fresh registry)
        code = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


@needs_plugin
@pytest.mark.slow
def test_without_the_cudnn_library_auto_warns_once_and_compiles_xla_attention(tmp_path, monkeypatch, capsys):
    result = _without_cudnn(monkeypatch, capsys, "hlo", str(RECIPES / "single.toml"), *BF16_TINY, "--target", "h100x1",
                            "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("shardkit: warning:")]
    assert len(warnings) == 1 and "cuDNN library cannot be loaded" in warnings[0], result.stderr
    assert "Traceback" not in result.stderr
    assert "__cudnn$fmha" not in (tmp_path / "optimized_hlo.txt").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["attention"]["kernel"] == "xla"
    plan = _without_cudnn(monkeypatch, capsys, "plan", str(RECIPES / "single.toml"), *BF16_TINY, "--target", "h100x1")
    assert plan.returncode == 0, plan.stderr
    assert sum(line.startswith("shardkit: warning:") for line in plan.stderr.splitlines()) == 1, plan.stderr
    assert re.search(r"^attention \(shardkit\.nn\.attention\): xla \(.*cuDNN cannot run: the cuDNN library cannot be "
                     r"loaded", plan.stdout, re.M)


@needs_plugin
@pytest.mark.slow
def test_without_the_cudnn_library_an_explicit_cudnn_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    for command in (("hlo", "--out", str(tmp_path / "hlo")), ("plan",)):
        result = _without_cudnn(monkeypatch, capsys, command[0], str(RECIPES / "single.toml"), *BF16_TINY,
                                "--set", "train.attention=cudnn", "--target", "h100x1", *command[1:])
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "train.attention" in result.stderr
        assert "cuDNN library cannot be loaded" in result.stderr
    assert not (tmp_path / "hlo").exists()


@needs_plugin
@pytest.mark.slow
def test_the_eval_step_runs_cudnn_attention_as_the_train_step_does(tmp_path, capsys):
    """The command in this process: what is held is the compiled program, which a fresh process compiles the same."""
    counts = {}
    for step in ("train", "eval"):
        out = tmp_path / step
        code = main(["hlo", str(RECIPES / "single.toml"), *BF16_TINY, "--target", "h100x1", "--step", step,
                     "--out", str(out)])
        assert code == 0, capsys.readouterr().err
        text = (out / "optimized_hlo.txt").read_text()
        counts[step] = len(re.findall(r'custom_call_target="__cudnn\$fmhaSoftmax"', text))
    assert counts["eval"] >= 1 and counts["train"] >= 1, counts
