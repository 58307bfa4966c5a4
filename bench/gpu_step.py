"""One GPU: shardkit's training step beside a hand-written JAX step of the same Llama, in the same run.

    python bench/gpu_step.py                  # the README table: 1b, bf16, seq 4096/8192/16384, remat x batch
    python bench/gpu_step.py --seq 4096 --batch 4 8 --remat full selective --steps 10
    python bench/gpu_step.py --seq 4096 --batch 4 --remat minimal_with_context --packing none documents
    python bench/gpu_step.py --smoke          # tiny model, 2 steps, in one process (the CPU test runs this)
    python bench/gpu_step.py --gemms-only --json gemms.json   # only the GEMM sweep below
    python bench/gpu_step.py --seq 4096 --batch 4 --remat full --steps 5 --json gpu.json   # one short run: a step
        # row of each, the FP8 rows, the generation rows and the GEMM sweep

The hand-written step (`stick_*` below, about 100 lines) is the measuring stick: the model of models/llama.py written
plainly with stacked weights, a `lax.scan` over the layers under `jax.checkpoint`, `jax.nn.dot_product_attention`
(cuDNN where the device is an NVIDIA GPU, XLA's elsewhere) with native grouped-query heads, fp32 parameters used in
bf16, an fp32 cross entropy, and optax AdamW after global-norm clipping. Both steps see the same batch size, sequence
length and remat preset; shardkit's runs recipes/single.toml with the same overrides.

Packed rows (`--packing documents`, on by default beside the unpacked ones): shardkit's step with
`data.packing = "documents"` on rows of documents of about `DOCUMENT_TOKENS` tokens (lengths drawn uniformly within
half of that either way, each ended by the end-of-document token `DOCUMENT_EOS`), so attention runs per document
(cuDNN's packed layout on Hopper). The hand-written step has no packing and gets no packed row.

Each row reports tokens/s (median step time after two warm-up steps), MFU by `shardkit.analysis.predicted.estimate`'s
formula (6 x parameters + attention per token, over the device's dense bf16 peak; "-" where the peak is unknown, e.g.
CPU), the device's measured peak memory (`memory_stats()["peak_bytes_in_use"]`, where the backend reports it) and the
compiled peak (`memory_analysis()`: arguments + outputs - aliased + temporaries). Outside `--smoke` every row runs in
its own process, so each measured peak is that row's alone and an out-of-memory row does not end the sweep.

After the steps, a GEMM sweep measures every shape of `shardkit.analysis.predicted.rates.GEMM_TABLE` for the device's
kind (each entry's M x N x K in its dtype: bf16, fp32 as TF32, FP8) beside the rate the table gives it, so that a GPU
run checks the table's entries and the interpolation between them (`--smoke`: two tiny shapes, any device). FP8 is timed
as the fp8 policy's matmuls compile: scaled e4m3 operands, one cuBLASLt FP8 GEMM (`scaled_fp8_matmul`). `--json` writes
`{"steps": [...], "fp8": [...], "generation": [...], "gemms": [...]}`.

After the steps come FP8 rows (`fp8_rows`): shardkit's step at the 8b preset's width with its layers cut to fit one
GPU, under bf16 and under fp8 (`--skip-fp8` leaves them out); and the generation rows (`generation_rows`,
bench/generate.py): the 1b preset, greedy, a 16-token prompt and 128 new tokens, shardkit's compiled loop beside
transformers' static cache where torch imports (`--skip-generation` leaves them out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30
DOCUMENT_TOKENS = 1500  # the packed rows' mean document length
DOCUMENT_EOS = 1  # their end-of-document token; the other tokens are drawn from [2, vocab)
# The stick's checkpoint policy for each shardkit remat preset (the hand-written step used these).
STICK_POLICIES = {"full": "nothing_saveable", "selective": "dots_with_no_batch_dims_saveable", "none": None}


@dataclasses.dataclass(frozen=True)
class Case:
    step: str  # "shardkit" or "stick"
    preset: str
    remat: str
    batch: int
    seq: int
    steps: int
    layers: int = 0  # 0: the preset's
    policy: str = "bf16"  # precision.policy of shardkit's step (the stick is bf16 alone)
    packing: str = "none"  # data.packing: "documents" packs documents of about DOCUMENT_TOKENS tokens

    def model_overrides(self) -> list[str]:
        return [f"model.preset={self.preset}"] + ([f"model.layers={self.layers}"] if self.layers else [])


# ---- the hand-written step ------------------------------------------------------------------------------------------
def stick_init(cfg, key):
    """Stacked fp32 weights of the Llama in models/llama.py (same shapes and scales)."""
    import jax
    import jax.numpy as jnp

    L, D, H, K, E, F, V = cfg.layers, cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.vocab
    keys = iter(jax.random.split(key, 10))
    normal = lambda shape, scale: jax.random.normal(next(keys), shape, jnp.float32) * scale
    params = {
        "embed": normal((V, D), 1.0), "final_norm": jnp.ones((D,)),
        "attn_norm": jnp.ones((L, D)), "mlp_norm": jnp.ones((L, D)),
        "wq": normal((L, D, H, E), D**-0.5), "wk": normal((L, D, K, E), D**-0.5), "wv": normal((L, D, K, E), D**-0.5),
        "wo": normal((L, H, E, D), (H * E) ** -0.5),
        "w_gate": normal((L, D, F), D**-0.5), "w_up": normal((L, D, F), D**-0.5), "w_down": normal((L, F, D), F**-0.5),
    }
    if not cfg.tie_embeddings:
        params["head"] = normal((D, V), D**-0.5)
    return params


def stick_norm(x, scale, eps):
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale).astype(x.dtype)


def stick_rotary(x, theta):
    import jax.numpy as jnp

    seq, dim = x.shape[1], x.shape[-1]
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    sin, cos = jnp.sin(angles)[None, :, None], jnp.cos(angles)[None, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def stick_block(cfg, implementation):
    import jax
    import jax.numpy as jnp

    def block(x, w):
        h = stick_norm(x, w["attn_norm"], cfg.norm_eps)
        q = stick_rotary(jnp.einsum("bsd,dhe->bshe", h, w["wq"]), cfg.rope_theta)
        k = stick_rotary(jnp.einsum("bsd,dke->bske", h, w["wk"]), cfg.rope_theta)
        v = jnp.einsum("bsd,dke->bske", h, w["wv"])
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        x = x + jnp.einsum("bshe,hed->bsd", attn, w["wo"])
        h = stick_norm(x, w["mlp_norm"], cfg.norm_eps)
        return x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"], None

    return block


def stick_loss(cfg, implementation, policy, params, tokens):
    import jax
    import jax.numpy as jnp
    import optax

    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    layers = {name: p[name] for name in ("attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    block = stick_block(cfg, implementation)
    if policy is not None:
        block = jax.checkpoint(block, policy=getattr(jax.checkpoint_policies, policy), prevent_cse=False)
    x, _ = jax.lax.scan(block, p["embed"][tokens[:, :-1]], layers)
    x = stick_norm(x, p["final_norm"], cfg.norm_eps)
    head = p["embed"].T * cfg.embed**-0.5 if cfg.tie_embeddings else p["head"]
    logits = (x @ head).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def stick_step(cfg, remat: str, implementation: str):
    """The jitted step (params, opt_state, tokens) -> (params, opt_state, loss), its optimizer, with donation."""
    import jax
    import optax

    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    policy = STICK_POLICIES.get(remat, "dots_with_no_batch_dims_saveable")

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: stick_loss(cfg, implementation, policy, p, tokens))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), optimizer


def attention_implementation(device) -> str:
    return "cudnn" if device.platform in ("gpu", "cuda") and "NVIDIA" in device.device_kind.upper() else "xla"


# ---- running one case -----------------------------------------------------------------------------------------------
def _recipe(case: Case):
    from shardkit.recipe import TrainSection, load_recipe

    overrides = [*case.model_overrides(), f"precision.policy={case.policy}", f"train.seq_len={case.seq}",
                 f"train.global_batch={case.batch}", f"train.remat={case.remat}", f"train.steps={case.steps}"]
    if case.packing == "documents":
        overrides += ["data.packing=documents", f"data.eos_id={DOCUMENT_EOS}"]
    if "attention" in {field.name for field in dataclasses.fields(TrainSection)}:
        overrides.append("train.attention=auto")  # cuDNN on NVIDIA GPUs once shardkit has the knob
    return load_recipe(ROOT / "recipes" / "single.toml", overrides)


def _tokens(case: Case, vocab: int, step: int):
    import jax

    if case.packing == "documents":
        return packed_tokens(case, vocab, step)
    return jax.random.randint(jax.random.key(step), (case.batch, case.seq + 1), 0, vocab)


def packed_tokens(case: Case, vocab: int, step: int):
    """Rows of documents of about DOCUMENT_TOKENS tokens (a quarter of the row where that is shorter, as under
    `--smoke`), each ended by DOCUMENT_EOS: random ids elsewhere, never the end-of-document id."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(step)
    mean = min(DOCUMENT_TOKENS, max(2, case.seq // 4))
    tokens = rng.integers(DOCUMENT_EOS + 1, vocab, (case.batch, case.seq + 1))
    for row in tokens:
        ends = np.cumsum(rng.integers(mean // 2, mean + mean // 2 + 1, case.seq // max(1, mean // 2) + 1))
        row[ends[ends < len(row)]] = DOCUMENT_EOS
    return jnp.asarray(tokens, jnp.int32)


def _shardkit_runner(case: Case):
    """(compiled step, state, config, compiled peak) of shardkit's step, compiled as `shardkit train` does."""
    import jax

    from shardkit.analysis.compiled.hlo import memory_stats
    from shardkit.layout import build_layout
    from shardkit.step import build_step
    from shardkit.xla_flags import compile_lowered

    layout = build_layout(_recipe(case), jax.devices()[:1])
    builder = build_step(layout)
    compiled = compile_lowered(builder.lower(), layout.recipe, layout.mesh)
    state = builder.init_state(0)
    sharding = builder.batch_sharding()

    def run(state, tokens):
        state, metrics = compiled(state, jax.device_put(tokens, sharding))
        return state, metrics["loss"]

    REPLAYED[case] = replayed_seconds(compiled, layout, jax.devices()[0].device_kind)
    return run, state, layout.config, memory_stats(compiled)["peak_bytes"]


# The replay's prediction of each shardkit case's compiled step, filled in when the case compiles.
REPLAYED: dict = {}


def replayed_seconds(compiled, layout, device_kind: str) -> float | None:
    """The step time the replay of this very program predicts
    (`shardkit.analysis.predicted.steptime.replayed_step_time`, what `suggest`, `plan --target` and `hlo --target`
    print), None where the device kind is not a target."""
    from shardkit.analysis.predicted.overlap import exposure_report
    from shardkit.analysis.predicted.steptime import replayed_step_time
    from shardkit.analysis.predicted.targets import parse_target

    kind = _target_kind(device_kind)
    if kind is None:
        return None
    target = parse_target(f"{kind}x1")
    return replayed_step_time(exposure_report(compiled, layout.mesh, target), layout, target).total


def _target_kind(device_kind: str) -> str | None:
    from shardkit.analysis.predicted.targets import GPUS

    return next((name for name in GPUS if "-" not in name and name in device_kind.lower()), None)


def _stick_runner(case: Case):
    import jax

    from shardkit.analysis.compiled.hlo import memory_stats
    from shardkit.recipe import load_recipe
    from shardkit.registry import load_model_class, model_config

    model = load_recipe(ROOT / "recipes" / "single.toml", case.model_overrides()).model
    cfg = model_config(load_model_class(model.name), model)
    step, optimizer = stick_step(cfg, case.remat, attention_implementation(jax.devices()[0]))
    params = stick_init(cfg, jax.random.key(0))
    opt_state = optimizer.init(params)
    compiled = step.lower(params, opt_state, _tokens(case, cfg.vocab, 0)).compile()

    def run(state, tokens):
        params, opt_state, loss = compiled(*state, tokens)
        return (params, opt_state), loss

    return run, (params, opt_state), cfg, memory_stats(compiled)["peak_bytes"]


def measure(case: Case) -> dict:
    """Train `case.steps` steps (two warm-up steps first) and return the row's figures."""
    import jax
    import numpy as np

    from shardkit.analysis.predicted.flops import training_flops_per_token
    from shardkit.analysis.predicted.targets import peak_flops

    run, state, cfg, compiled_peak = (_shardkit_runner if case.step == "shardkit" else _stick_runner)(case)
    times, losses = [], []
    for step in range(case.steps + 2):
        tokens = _tokens(case, cfg.vocab, step)
        began = time.perf_counter()
        state, loss = run(state, tokens)
        losses.append(float(jax.block_until_ready(loss)))
        times.append(time.perf_counter() - began)
    seconds = statistics.median(times[2:]) if case.steps > 0 else times[-1]
    tokens_per_s = case.batch * case.seq / seconds
    parameters = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(state[0] if case.step == "stick"
                                                                             else state["params"]))
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind)
    flops = training_flops_per_token(cfg, parameters, case.seq) * tokens_per_s
    stats = device.memory_stats() or {}
    return {**dataclasses.asdict(case), "device": device.device_kind, "jax": jax.__version__,
            "tokens_per_s": tokens_per_s, "mfu": flops / peak if peak else None, "loss": losses[-1],
            "peak_bytes": stats.get("peak_bytes_in_use"), "compiled_peak_bytes": compiled_peak,
            "step_s": seconds, "predicted_step_s": predicted_seconds(case, device.device_kind),
            "replayed_step_s": REPLAYED.get(case)}


def predicted_seconds(case: Case, device_kind: str) -> float | None:
    """shardkit's analytic step time (`shardkit.analysis.predicted.step_model.step_time`) for the same recipe on one
    device of this kind, or None where the kind is not a target (CPU): recorded beside the measured time, so every GPU
    run is a calibration point of the model (`shardkit.analysis.predicted.kernels.OVERHEAD`)."""
    from shardkit.analysis.predicted.step_model import step_time
    from shardkit.analysis.predicted.targets import parse_target
    from shardkit.analysis.search.planned import base_layout, candidate_layout

    kind = _target_kind(device_kind)
    if kind is None:
        return None
    recipe, target = _recipe(case), parse_target(f"{kind}x1")
    return step_time(candidate_layout(base_layout(recipe), recipe, target), target).total


def measure_in_subprocess(case: Case) -> dict:
    """One case in a fresh process: its own peak memory, and an out-of-memory row that does not end the sweep."""
    command = [sys.executable, __file__, "--one", json.dumps(dataclasses.asdict(case))]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["failed"])[-1]
        return {**dataclasses.asdict(case), "error": "out of memory" if "RESOURCE_EXHAUSTED" in result.stderr
                else last[:120]}
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- GEMM rates: the table's shapes, measured -----------------------------------------------------------------------
# The operand dtype of each of the table's dtype classes, and the dtype its products are written in.
GEMM_DTYPES = {"bf16": ("bfloat16", "bfloat16"), "tf32": ("float32", "float32"), "fp8": ("float8_e4m3fn", "bfloat16")}
GEMM_REPEATS = 20
GEMM_HEADER = f"{'dtype':<5} {'M':>6} {'N':>6} {'K':>6} {'ms':>9} {'TFLOP/s':>8} {'table':>8}"


@dataclasses.dataclass(frozen=True)
class GemmCase:
    """One GEMM to time: the table's dtype class and its M x N x K."""

    dtype: str
    m: int
    n: int
    k: int


SMOKE_GEMMS = (GemmCase("bf16", 64, 32, 16), GemmCase("tf32", 64, 32, 16))


def gemm_cases(device_kind: str) -> list[GemmCase]:
    """Every entry of the GEMM table for this device kind (its shape in its dtype); none where the kind is not a
    target (CPU)."""
    from shardkit.analysis.predicted.rates import GEMM_TABLE

    kind = _target_kind(device_kind)
    if kind is None:
        return []
    return [GemmCase(dtype, *point.shape) for dtype, curve in GEMM_TABLE[kind].items() for point in curve.points]


def measure_gemm(case: GemmCase, repeats: int = GEMM_REPEATS) -> dict:
    """Time `case` on the first device: one warm-up call, then `repeats` calls dispatched back to back (JAX dispatches
    asynchronously, so the device runs them one after another) and timed together. A GEMM shorter than the dispatch
    itself (tens of microseconds) is timed by its dispatch: its rate is then a lower bound."""
    import jax

    operands = gemm_operands(case)
    matmul = gemm_function(case)
    jax.block_until_ready(matmul(*operands))
    began = time.perf_counter()
    for _ in range(repeats):
        out = matmul(*operands)
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - began) / repeats
    device = jax.devices()[0]
    return {**dataclasses.asdict(case), "device": device.device_kind, "seconds": seconds,
            "flops": 2.0 * case.m * case.n * case.k / seconds, "table_flops": table_flops(case, device.device_kind)}


def gemm_operands(case: GemmCase) -> tuple:
    """The arrays `gemm_function(case)` takes, drawn from a normal distribution: A (M x K) and B (K x N) in the case's
    operand dtype, or for FP8 `fp8_operands`."""
    import jax
    import jax.numpy as jnp

    if case.dtype == "fp8":
        return fp8_operands(case)
    operand = jnp.dtype(GEMM_DTYPES[case.dtype][0])
    keys = jax.random.split(jax.random.key(0))
    return (jax.random.normal(keys[0], (case.m, case.k), jnp.float32).astype(operand),
            jax.random.normal(keys[1], (case.k, case.n), jnp.float32).astype(operand))


def gemm_function(case: GemmCase):
    """The jitted GEMM the sweep times for `case`: `jnp.matmul` with products in the case's product dtype, or for FP8
    `scaled_fp8_matmul` under the XLA flags shardkit adds to an fp8 policy's compile (`FP8_DEFAULTS`: no Triton
    GEMMs, so the FP8 dot is a cuBLASLt FP8 GEMM; the other GPU defaults are left out, as for bf16 and tf32)."""
    import jax
    import jax.numpy as jnp

    if case.dtype == "fp8":
        from shardkit.xla_flags import FP8_DEFAULTS

        return jax.jit(scaled_fp8_matmul, compiler_options=dict(FP8_DEFAULTS))
    product = jnp.dtype(GEMM_DTYPES[case.dtype][1])
    return jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=product))


def fp8_operands(case: GemmCase) -> tuple:
    """FP8 operands as the fp8 policy makes them (`shardkit.nn.dot`): A and B drawn in the compute dtype, each quantized
    to e4m3 by Flax's `fp8_ops.quantize` at the scale delayed scaling derives from its amax (`compute_scale`), and
    those two scales. Quantized here, outside the timed GEMM, as the table prices the GEMM alone.

    B is stored N x K (K-major): cuBLASLt's FP8 GEMM takes both operands so, and `shardkit.nn.dot` compiled for an
    H100 quantizes its K x N weights into that layout in one fusion; stored K x N here, each timed call would also
    run a transpose."""
    import jax
    import jax.numpy as jnp
    from flax.linen import fp8_ops

    operand, compute = (jnp.dtype(name) for name in GEMM_DTYPES["fp8"])
    keys = jax.random.split(jax.random.key(0))
    a_MK = jax.random.normal(keys[0], (case.m, case.k), jnp.float32).astype(compute)
    b_NK = jax.random.normal(keys[1], (case.n, case.k), jnp.float32).astype(compute)
    fp8_max = fp8_ops.get_fp8_max(operand, jnp.float32)
    scales = [fp8_ops.compute_scale(jnp.max(jnp.abs(x)).astype(jnp.float32), jnp.float32(1), fp8_max)
              for x in (a_MK, b_NK)]
    quantized = [fp8_ops.quantize(x, operand, scale, compute) for x, scale in zip((a_MK, b_NK), scales)]
    return (*quantized, *scales)


def scaled_fp8_matmul(a_MK, b_NK, a_scale, b_scale):
    """A @ B.T for e4m3 operands with their scales, written as XLA's GEMM rewriter matches an FP8 GEMM: each operand
    converted to the compute dtype and multiplied by its scale (Flax's `fp8_ops.dequantize`), then one dot. XLA:GPU
    makes this one cuBLASLt FP8 GEMM (`__cublas$lt$matmul$f8`) taking the scales as operands, the custom call the fp8
    policy's matmuls compile to (under `FP8_DEFAULTS`). The sweep's first form, an f8 x f8 `jnp.matmul` with no
    scales compiled under JAX's default flags, is a Triton GEMM fusion in a deviceless H100 compile."""
    import jax.numpy as jnp
    from flax.linen import fp8_ops
    from jax import lax

    compute = jnp.dtype(GEMM_DTYPES["fp8"][1])
    contract_K = (((1,), (1,)), ((), ()))
    return lax.dot_general(fp8_ops.dequantize(a_MK, compute, a_scale), fp8_ops.dequantize(b_NK, compute, b_scale),
                           contract_K)


def table_flops(case: GemmCase, device_kind: str) -> float | None:
    """The rate `shardkit.analysis.predicted.rates` prices this GEMM at (its curve, or the HBM floor where that is
    slower) on this device kind; None where the kind is not a target."""
    from shardkit.analysis.predicted.rates import DTYPE_BY_ITEMSIZE, RATES, gemm_seconds

    kind = _target_kind(device_kind)
    if kind is None:
        return None
    itemsize = {dtype: size for size, dtype in DTYPE_BY_ITEMSIZE.items()}[case.dtype]
    return 2.0 * case.m * case.n * case.k / gemm_seconds(RATES[kind], case.m, case.n, case.k, itemsize)


def format_gemm_row(row: dict) -> str:
    table = f"{row['table_flops'] / 1e12:>8.1f}" if row["table_flops"] is not None else f"{'-':>8}"
    return (f"{row['dtype']:<5} {row['m']:>6} {row['n']:>6} {row['k']:>6} {1e3 * row['seconds']:>9.4f} "
            f"{row['flops'] / 1e12:>8.1f} {table}")


def gemm_sweep(cases_to_time: list[GemmCase]) -> list[dict]:
    """Time each case and print its row; a shape the device cannot run (no FP8 there, out of memory) gets an error."""
    rows = []
    print(GEMM_HEADER, flush=True)
    for case in cases_to_time:
        try:
            rows.append(measure_gemm(case))
            print(format_gemm_row(rows[-1]), flush=True)
        except Exception as err:  # noqa: BLE001 - XLA raises several runtime error types for one unrunnable shape
            rows.append({**dataclasses.asdict(case), "error": str(err).splitlines()[0][:120]})
            print(f"{case.dtype:<5} {case.m:>6} {case.n:>6} {case.k:>6} {rows[-1]['error']}", flush=True)
    return rows


# ---- the table ------------------------------------------------------------------------------------------------------
HEADER = (f"{'step':<15} {'remat':<10} {'batch':>5} {'seq':>6} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} "
          f"{'compiled':>9} {'step s':>7} {'analytic':>9} {'replayed':>9}")


def format_row(row: dict) -> str:
    def gib(value):
        return f"{value / GIB:.2f}" if value is not None else "-"

    step = row["step"] + ("" if row.get("policy", "bf16") == "bf16" else f"/{row['policy']}")
    step += "/packed" if row.get("packing") == "documents" else ""
    head = f"{step:<15} {row['remat']:<10} {row['batch']:>5} {row['seq']:>6}"
    if "error" in row:
        return f"{head} {row['error']}"
    mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-"
    predicted, replayed = (f"{row[key]:.3f}" if row.get(key) is not None else "-"
                           for key in ("predicted_step_s", "replayed_step_s"))
    return (f"{head} {row['tokens_per_s']:>10,.0f} {mfu:>6} {gib(row['peak_bytes']):>9} "
            f"{gib(row['compiled_peak_bytes']):>9} {row.get('step_s', 0.0):>7.3f} {predicted:>9} {replayed:>9}")


def cases(args) -> list[Case]:
    """Each (seq, remat, batch)'s rows: shardkit's and the stick's unpacked, shardkit's packed (the stick packs
    none)."""
    return [Case(step, args.preset, remat, batch, seq, args.steps, args.layers, packing=packing)
            for seq in args.seq for remat in args.remat for batch in args.batch for packing in args.packing
            for step in ("shardkit", "stick") if packing == "none" or step == "shardkit"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="1b", help="model.preset of models/llama.py (default 1b)")
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--remat", nargs="+", default=["full", "selective"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps after two warm-up steps")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    parser.add_argument("--packing", nargs="+", default=["none", "documents"], choices=["none", "documents"],
                        help="data.packing of shardkit's rows (documents: DOCUMENT_TOKENS-token documents a row)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model of 2 layers, seq 32, batch 2, full remat, 1 timed step, in-process")
    parser.add_argument("--gemms-only", action="store_true",
                        help="only the GEMM sweep over the rate table's shapes for this device (no training steps)")
    parser.add_argument("--skip-fp8", action="store_true", help="leave out the FP8 rows at the 8b preset's width")
    parser.add_argument("--skip-generation", action="store_true", help="leave out the generation rows")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one case as JSON, in this process
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.layers, args.seq, args.batch, args.remat, args.steps = "tiny", 2, [32], [2], ["full"], 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure(Case(**json.loads(args.one)))))
        return 0
    rows = [] if args.gemms_only else step_rows(args)
    fp8 = [] if args.gemms_only or args.skip_fp8 else fp8_rows(args)
    generation = [] if args.gemms_only or args.skip_generation else generation_rows(args)
    gemms = gemm_sweep(list(SMOKE_GEMMS) if args.smoke else gemm_cases(_device_kind()))
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": rows, "fp8": fp8, "generation": generation, "gemms": gemms},
                                              indent=1))
    return 0


def step_rows(args) -> list[dict]:
    """Each case's row, printed as it comes (in this process under `--smoke`, else one process per case)."""
    print(HEADER, flush=True)
    rows = []
    for case in cases(args):
        rows.append(measure(case) if args.smoke else measure_in_subprocess(case))
        print(format_row(rows[-1]), flush=True)
    if rows and "device" in rows[0]:
        print(f"device {rows[0]['device']}, jax {rows[0]['jax']}")
    return rows


# ---- FP8 at the 8b preset's width -----------------------------------------------------------------------------------
# The 8b preset's width (embed 4096, mlp 14336, 32 query and 8 KV heads, vocab 128256) with its layers cut so that the
# bf16-params state (params, fp32 master copy, Adam moments) of embedding, head and layers fits one 80 GB GPU beside
# the activations: shardkit's step under bf16 and under fp8, same batch, sequence and remat.
FP8_WIDTH = {"preset": "8b", "layers": 4, "seq": 4096, "batch": 2, "remat": "full"}
FP8_SMOKE = {"preset": "tiny", "layers": 2, "seq": 32, "batch": 2, "remat": "full"}


def fp8_cases(args) -> list[Case]:
    """shardkit's step at the 8b preset's width (`FP8_WIDTH`; `--smoke`: the tiny preset), bf16 then fp8."""
    shape = FP8_SMOKE if args.smoke else FP8_WIDTH
    return [Case("shardkit", shape["preset"], shape["remat"], shape["batch"], shape["seq"], args.steps, shape["layers"],
                 policy) for policy in ("bf16", "fp8")]


def fp8_rows(args) -> list[dict]:
    """The FP8 rows beside bf16's, printed as they come (in this process under `--smoke`, else one process each)."""
    shape = FP8_SMOKE if args.smoke else FP8_WIDTH
    print(f"fp8 vs bf16: {shape['preset']} preset's width, {shape['layers']} layers", flush=True)
    print(HEADER, flush=True)
    rows = []
    for case in fp8_cases(args):
        rows.append(measure(case) if args.smoke else measure_in_subprocess(case))
        print(format_row(rows[-1]), flush=True)
    return rows


# ---- generation beside transformers ---------------------------------------------------------------------------------
# The generation row: the 1b preset in bf16, greedy, a 16-token prompt and 128 new tokens, shardkit's compiled loop
# beside transformers' static cache (bench/generate.py; transformers only where torch and transformers import).
GENERATION = ["--preset", "1b", "--policy", "bf16", "--prompt", "16", "--tokens", "128", "--repeats", "3", "--hf",
              "--skip-host-loop"]
GENERATION_SMOKE = ["--preset", "tiny", "--prompt", "8", "--tokens", "8", "--repeats", "1", "--hf"]


def generation_rows(args) -> list[dict]:
    """bench/generate.py's rows (in this process under `--smoke`, else in its own), each printed as one line."""
    print("generation: greedy, tokens/s", flush=True)
    options = GENERATION_SMOKE if args.smoke else GENERATION
    if args.smoke:
        sys.path.insert(0, str(ROOT / "bench"))
        import generate

        rows = generate.rows(generate.parse_args(options))
    else:
        command = [sys.executable, str(ROOT / "bench" / "generate.py"), *options]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        rows = [json.loads(line) for line in lines] or [{"error": (result.stderr.strip().splitlines() or ["failed"])[-1]
                                                         [:120]}]
    for row in rows:
        print(format_generation_row(row), flush=True)
    return rows


def format_generation_row(row: dict) -> str:
    if "path" not in row:
        return "  " + ", ".join(f"{key} {value}" for key, value in row.items())
    figure = row["error"] if "error" in row else f"{row['tokens_per_s']:>10,.1f} tokens/s ({row['tokens']} tokens)"
    return f"  {row['path']:<26} {row['preset']:<5} {figure}"


def _device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


if __name__ == "__main__":
    sys.exit(main())
