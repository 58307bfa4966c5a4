"""The fp8 precision policy: the layer stack's matmuls in FP8 with delayed scaling (Flax's fp8_scaled_dot_general),
the scaling state in the train state, sharded along `layers`, updated by each step, resumed exactly after kill -9;
losses that fall like bf16's; cuBLASLt FP8 GEMMs in the program compiled for an H100 target."""

from __future__ import annotations

import json
import re
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from shardkit.analysis.predicted.targets import cuda_plugin_available
from shardkit.cli import main
from shardkit.layout import build_layout
from shardkit.nn import Fp8Scaling, dot, fp8_scaling, model_context
from shardkit.precision import AMAX_HISTORY, fp8_site_state, parse_policy
from shardkit.recipe import load_recipe
from shardkit.step import build_step
from tests.helpers import ROOT

LLAMA_SITES = ("attn/k", "attn/o", "attn/q", "attn/v", "mlp/down", "mlp/gate", "mlp/up")
QUICKSTART_STEPS = 30
# The quickstart recipe on a two-layer model and half its batch: what the losses-fall-like-bf16 run, the step test that
# shares its compile and the kill -9 run train. Enough tokens per step for the loss to fall to under 0.3 of its start
# within the 30 steps; the layer stack stays a stack (the scaling state is per layer).
SMALL = ("model.layers=2", "train.global_batch=8")


def _builder(*overrides: str, recipe: str = "fsdp.toml"):
    return build_step(build_layout(load_recipe(ROOT / "recipes" / recipe, ["precision.policy=fp8", *overrides])))


def test_the_fp8_policy_computes_in_bf16_and_scales_its_matmuls():
    policy = parse_policy("fp8")
    assert policy.fp8 and policy.compute_dtype == jnp.bfloat16 and policy.param_dtype == jnp.float32
    assert not policy.loss_scaling and not policy.master_weights
    assert not parse_policy("bf16").fp8


def test_dot_is_einsum_outside_fp8_and_close_to_it_inside():
    x_BSD = jax.random.normal(jax.random.key(0), (2, 8, 32), jnp.bfloat16)
    w_DF = jax.random.normal(jax.random.key(1), (32, 16), jnp.bfloat16)
    exact = jnp.einsum("bsd,df->bsf", x_BSD, w_DF)
    assert jnp.array_equal(dot("bsd,df->bsf", x_BSD, w_DF, "mlp/up"), exact)
    with fp8_scaling({"mlp/up": fp8_site_state((1,))}):  # outside the layer stack: no FP8
        assert jnp.array_equal(dot("bsd,df->bsf", x_BSD, w_DF, "mlp/up"), exact)
    with model_context(fp8=Fp8Scaling({}, layer={"mlp/up": fp8_site_state()})):  # inside a layer of it
        quantized = dot("bsd,df->bsf", x_BSD, w_DF, "mlp/up")
    assert not jnp.array_equal(quantized, exact)  # e4m3 keeps 3 mantissa bits
    relative = jnp.linalg.norm((quantized - exact).astype(jnp.float32)) / jnp.linalg.norm(exact.astype(jnp.float32))
    assert relative < 0.08


def test_the_scaling_state_is_one_per_layer_and_site_laid_out_along_layers():
    builder = _builder("mesh.data=2", "mesh.fsdp=4", 'rules.params.layers="data"')
    assert builder.fp8_sites == LLAMA_SITES
    abstract = builder.abstract_state()["fp8"]
    layers = builder.layout.config.layers
    assert builder.state_shardings()["params"]["blocks"]["mlp"]["w_up_DF"].spec[0] == "data"
    for site in LLAMA_SITES:
        assert abstract[site]["lhs_scale"].shape == (layers, 1)
        assert abstract[site]["grad_amax_history"].shape == (layers, AMAX_HISTORY)
        assert abstract[site]["rhs_amax_history"].sharding.spec == PartitionSpec("data", None)  # as the weights


@pytest.mark.slow
def test_a_step_records_each_sites_amax_and_rescales_on_the_next():
    # The fp8 step the 30-step quickstart run below compiles (same recipe and schedule): compiled once for both.
    builder = _builder(f"train.steps={QUICKSTART_STEPS}", *SMALL)
    step = builder.jit()
    state = builder.init_state(seed=0)
    batch, seq_len = builder.recipe.train.global_batch, builder.recipe.train.seq_len
    tokens = jax.random.randint(jax.random.key(0), (batch, seq_len + 1),
                                0, builder.layout.config.vocab)
    state, _ = step(state, tokens)
    for site in LLAMA_SITES:
        for name in ("lhs_amax_history", "rhs_amax_history", "grad_amax_history"):
            history = np.asarray(state["fp8"][site][name])
            assert (history[:, 0] > 0).all() and (history[:, 1:] == 0).all(), (site, name)
        assert (np.asarray(state["fp8"][site]["rhs_scale"]) == 1).all()  # the first step scales by the empty history
    state, _ = step(state, tokens)
    rhs_scale = np.asarray(state["fp8"]["mlp/up"]["rhs_scale"])
    amax = np.asarray(state["fp8"]["mlp/up"]["rhs_amax_history"])[:, -1]  # the first step's, rolled to the end
    np.testing.assert_allclose(rhs_scale[:, 0], amax / float(jnp.finfo(jnp.float8_e4m3fn).max), rtol=1e-6)


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fp8_losses_fall_like_bf16_over_30_steps_on_the_quickstart_recipe(tmp_path):
    losses = {}
    for policy in ("bf16", "fp8"):
        out = tmp_path / policy
        recipe = str(ROOT / "recipes" / "fsdp.toml")
        overrides = [arg for override in SMALL for arg in ("--set", override)]
        assert main(["train", recipe, "--steps", str(QUICKSTART_STEPS), "--out", str(out), "--set",
                     f"precision.policy={policy}", "--set", "checkpoint.every=0", *overrides]) == 0
        losses[policy] = _losses(out)
    bf16, fp8 = np.asarray(losses["bf16"]), np.asarray(losses["fp8"])
    assert fp8[-1] < 0.3 * fp8[0]
    np.testing.assert_allclose(fp8, bf16, rtol=0.02)  # measured: at most 0.5% apart


@pytest.mark.slow
def test_kill_9_and_resume_under_fp8_gives_the_same_losses(tmp_path):
    """The scaling state (amax histories, scales) restored after kill -9 continues the run bit for bit: killed two
    steps after a checkpoint (before the next one), the rerun resumes from it and recomputes those two steps from the
    restored histories and scales exactly as the killed run, uninterrupted until then, computed them; then it
    finishes the run. (The killed run is its own uninterrupted reference: no third process.)"""
    from tests.helpers import losses_of, metrics_records, resumed_from, run_process, start_process, wait_for

    steps, every = 9, 4  # killed two steps past the checkpoint at 4, two short of the next: the metrics trail the loop
    out = tmp_path / "run"
    command = [sys.executable, "-m", "shardkit", "train", str(ROOT / "recipes" / "fsdp.toml"), "--devices", "2",
               "--out", str(out), "--steps", str(steps), "--set", "precision.policy=fp8",
               "--set", f"checkpoint.every={every}", *[arg for override in SMALL for arg in ("--set", override)]]
    process = start_process(command, tmp_path / "killed.log")
    wait_for(lambda: len(metrics_records(out)) >= every + 2, process, f"step {every + 2}")
    process.send_signal(signal.SIGKILL)
    process.wait()
    uninterrupted = losses_of(out)
    assert every + 2 <= len(uninterrupted) < 2 * every, uninterrupted
    assert resumed_from(run_process(command, tmp_path / "rerun.log")) == every
    resumed = losses_of(out)
    assert [record[0] for record in resumed] == list(range(1, steps + 1))
    assert resumed[:len(uninterrupted)] == uninterrupted


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="compiling for an H100 target needs the jax[cuda12] plugin")
def test_the_matmuls_compile_to_cublaslt_fp8_gemms_for_an_h100(tmp_path):
    assert main(["hlo", str(ROOT / "recipes" / "fsdp.toml"), "--set", "precision.policy=fp8", "--target", "h100x8",
                 "--out", str(tmp_path)]) == 0
    text = (tmp_path / "optimized_hlo.txt").read_text()
    types = dict(re.findall(r"^\s*%(\S+) = \(?([a-z0-9]+)\[", text, re.M))
    operands = [
        tuple(types.get(name.lstrip("%")) for name in match.split(", ")[:2])
        for match in re.findall(r'custom-call\(([^)]*)\), custom_call_target="__cublas\$lt\$matmul\$f8"', text)
    ]
    sites = len(LLAMA_SITES)  # each site: one forward GEMM (e4m3 x e4m3) and two backward ones (e5m2 gradient)
    assert operands.count(("f8e4m3fn", "f8e4m3fn")) == sites
    assert sum("f8e5m2" in pair for pair in operands) == 2 * sites


def test_the_analytic_model_counts_fp8_gemms_and_scaling_state():
    from shardkit.analysis.predicted.estimate import memory_estimate
    from shardkit.analysis.predicted.kernels import compute_time
    from shardkit.analysis.predicted.memory_terms import fp8_state_bytes
    from shardkit.analysis.predicted.rates import RATES

    def layout(policy):
        return build_layout(load_recipe(ROOT / "recipes" / "fsdp.toml", ["model.preset=1b",
                                                                         f"precision.policy={policy}"]))

    bf16, fp8 = layout("bf16"), layout("fp8")
    bf16_gemm, fp8_gemm = compute_time(bf16, RATES["h100"]).gemm, compute_time(fp8, RATES["h100"]).gemm
    assert 0.5 * bf16_gemm < fp8_gemm < 0.75 * bf16_gemm  # the layers' GEMMs at twice the rate, the head's not
    state = fp8_state_bytes(fp8)
    assert state == 16 * 7 * (3 + 3 * AMAX_HISTORY) * 4  # 1b: 16 layers, replicated under fsdp
    assert memory_estimate(fp8).params == pytest.approx(memory_estimate(bf16).params + state)
