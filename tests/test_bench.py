"""`shardkit bench collectives`: nccl-tests' bandwidth conventions, the printed table, and bad input.

The bus-bandwidth factors are those of nccl-tests' `*GetBw` functions (doc/PERFORMANCE.md there): all-reduce
2(n-1)/n, all-gather and reduce-scatter (n-1)/n, alltoall (n-1)/n (nccl-tests' alltoall.cu, not 1), sendrecv 1.
"""

from __future__ import annotations

import pytest

from shardkit.analysis.compiled.collectives import OPS, BenchResult
from shardkit.analysis.predicted.targets import cuda_plugin_available
from shardkit.cli import main

NCCL_TESTS_BUS_FACTORS = {
    "all-reduce": 2 * 7 / 8, "all-gather": 7 / 8, "reduce-scatter": 7 / 8, "all-to-all": 7 / 8, "ppermute": 1.0,
}


@pytest.mark.parametrize("op", OPS)
def test_bus_bandwidth_follows_nccl_tests(op):
    result = BenchResult(op, bytes=8 * 2**20, devices=8, seconds=1e-3)
    assert result.algbw == 8 * 2**20 / 1e-3
    assert result.busbw == pytest.approx(result.algbw * NCCL_TESTS_BUS_FACTORS[op], rel=1e-12)


def test_bench_prints_one_row_per_op_and_size(capsys):
    ops = ("all-reduce", "all-gather")
    assert main(["bench", "collectives", "--sizes", "1K", "--repeats", "1", "--ops", ",".join(ops)]) == 0
    header, *rows = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["op", "bytes", "devices", "time", "(us)", "algbw", "GB/s", "busbw", "GB/s"]
    assert [row.split()[:4] for row in rows] == [[op, "1.00", "KiB", "8"] for op in ops]
    for op, row in zip(ops, rows):
        micros, algbw, busbw = (float(cell) for cell in row.split()[4:])
        assert micros > 0 and algbw == pytest.approx(1024 / (micros * 1e-6) / 1e9, rel=0.01, abs=5e-4)
        # Printed with 3 decimals: allow each figure's rounding.
        assert busbw == pytest.approx(algbw * NCCL_TESTS_BUS_FACTORS[op], abs=5e-4 * (1 + NCCL_TESTS_BUS_FACTORS[op]))


@pytest.mark.parametrize("args, field", [
    (["--ops", "all-reduce,foo"], "--ops"),
    (["--sizes", "1Q"], "--sizes"),
    (["--repeats", "0"], "--repeats"),
])
def test_bad_bench_input_exits_2_before_printing_anything(args, field, capsys):
    assert main(["bench", "collectives", "--sizes", "1K", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and field in err


@pytest.mark.slow
def test_gpu_step_smoke_runs_both_steps_and_prints_the_table(tmp_path):
    """bench/gpu_step.py --smoke on this machine's first device: shardkit's step and the hand-written one each train
    (tiny Llama, 2 layers, 1 timed step), and shardkit's on packed documents; the table has one row for each, with
    finite, near losses; the tiny GEMM sweep follows, and the JSON holds both; between them the FP8 rows (shardkit's
    step under bf16 and fp8) and the generation rows (shardkit's compiled loop and its host-loop check, the same
    tokens; transformers' where torch imports)."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT

    gemm_header = load_bench("gpu_step").GEMM_HEADER
    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, "bench/gpu_step.py", "--smoke", "--json", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    header, *rows, footer = lines[:next(i for i, line in enumerate(lines) if line.startswith("fp8 vs bf16"))]
    assert header.split()[:6] == ["step", "remat", "batch", "seq", "tokens/s", "MFU"]
    assert [row.split()[:4] for row in rows] == [["shardkit", "full", "2", "32"], ["stick", "full", "2", "32"],
                                                 ["shardkit/packed", "full", "2", "32"]]
    assert footer.startswith("device ") and gemm_header in lines
    written = json.loads(out.read_text())
    assert [(g["dtype"], g["m"], g["n"], g["k"]) for g in written["gemms"]] == [("bf16", 64, 32, 16),
                                                                                ("tf32", 64, 32, 16)]
    shardkit, stick, packed = written["steps"]
    assert packed["packing"] == "documents" and shardkit["packing"] == "none"
    assert all(row["tokens_per_s"] > 0 and row["compiled_peak_bytes"] > 0 for row in (shardkit, stick, packed))
    # A few steps from random init on random tokens: the losses are finite and of the order of ln(vocab) = 5.5
    # (they differ: the stick's optimizer has no warmup schedule, and its initial weights are drawn differently).
    for row in (shardkit, stick, packed):
        assert 3.0 < row["loss"] < 8.0, row
    assert [(row["policy"], row["preset"]) for row in written["fp8"]] == [("bf16", "tiny"), ("fp8", "tiny")]
    assert all(row["tokens_per_s"] > 0 and 3.0 < row["loss"] < 8.0 for row in written["fp8"]), written["fp8"]
    paths = [row.get("path") for row in written["generation"]]
    assert paths == ["kv_cache", "host_loop", "transformers_static_cache", None], written["generation"]
    assert written["generation"][-1]["identical"] and written["generation"][0]["tokens"] == 8


def load_bench(name: str):
    """A script of bench/ as a module (bench/ is not a package)."""
    import importlib.util
    import sys

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_step_gemm_sweep_times_the_rate_tables_shapes_for_the_device_kind():
    """The sweep bench/gpu_step.py runs after its steps: on an H100 every entry of `rates.GEMM_TABLE["h100"]` in its
    dtype, none on CPU; a tiny case timed here has its FLOP/s from its own time, and the H100's table rate beside it
    (the 8192^3 bf16 entry at this project's measured 798 TFLOP/s)."""
    from shardkit.analysis.predicted.rates import GEMM_TABLE

    gpu_step = load_bench("gpu_step")
    h100 = gpu_step.gemm_cases("NVIDIA H100 80GB HBM3")
    assert [(c.dtype, (c.m, c.n, c.k)) for c in h100] == [
        (dtype, point.shape) for dtype, curve in GEMM_TABLE["h100"].items() for point in curve.points]
    assert gpu_step.GemmCase("bf16", 8192, 8192, 8192) in h100 and gpu_step.gemm_cases("cpu") == []
    assert gpu_step.table_flops(gpu_step.GemmCase("bf16", 8192, 8192, 8192), "NVIDIA H100 80GB HBM3") == 798e12
    row = gpu_step.measure_gemm(gpu_step.GemmCase("tf32", 64, 32, 16), repeats=2)
    assert row["seconds"] > 0 and row["flops"] == pytest.approx(2 * 64 * 32 * 16 / row["seconds"])
    assert row["table_flops"] is None and gpu_step.format_gemm_row(row).split()[:4] == ["tf32", "64", "32", "16"]


def test_gpu_step_fp8_gemm_multiplies_amax_scaled_e4m3_operands():
    """The sweep's FP8 case: A (M x K) and B (N x K) quantized to e4m3 at the scale their amax gives (so each reaches
    e4m3's largest value, 448) and the product of the dequantized operands, A @ B.T, in bf16; timed here on CPU."""
    import jax.numpy as jnp
    import numpy as np

    gpu_step = load_bench("gpu_step")
    case = gpu_step.GemmCase("fp8", 64, 32, 16)
    a_MK, b_NK, a_scale, b_scale = operands = gpu_step.gemm_operands(case)
    assert (a_MK.shape, b_NK.shape) == ((64, 16), (32, 16)) and a_MK.dtype == b_NK.dtype == jnp.float8_e4m3fn
    assert [float(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in (a_MK, b_NK)] == [448.0, 448.0]
    out = gpu_step.gemm_function(case)(*operands)
    a = np.asarray(a_MK, np.float64) * float(a_scale)
    b = np.asarray(b_NK, np.float64) * float(b_scale)
    # bf16 rounds each scale and each dequantized element (4 roundings per product term) and the output (1): at most
    # 5 units of bf16 roundoff (2^-8) of sum_k |a_mk b_nk| apart. A scale left out is off by a factor near 100.
    bound = 5 * 2**-8 * (np.abs(a) @ np.abs(b).T)
    assert out.dtype == jnp.bfloat16 and np.all(np.abs(np.asarray(out, np.float64) - a @ b.T) <= bound)
    row = gpu_step.measure_gemm(case, repeats=2)
    assert row["seconds"] > 0 and row["flops"] == pytest.approx(2 * 64 * 32 * 16 / row["seconds"])


def _entry_instructions(hlo_text: str) -> list[tuple[str, str, list[str], str]]:
    """(name, opcode, operand names, line) of each instruction of an optimized HLO module's ENTRY computation."""
    import re

    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    instruction = re.compile(r"^\s*(?:ROOT )?%(\S+) = (?:\([^)]*\)|\S+) ([a-z][a-z0-9-]*)\(([^)]*)\)(.*)$")
    rows = [instruction.match(line) for line in entry.splitlines()[1:]]
    return [(m[1], m[2], [name.lstrip("%") for name in m[3].split(", ") if name], m[0]) for m in rows if m]


@pytest.mark.skipif(not cuda_plugin_available(), reason="compiling for an H100 target needs the jax[cuda12] plugin")
def test_gpu_step_fp8_gemms_compile_to_one_cublaslt_fp8_gemm_for_an_h100():
    """Each FP8 entry of the H100's GEMM table, as the sweep times it, compiled deviceless for an h100x1 target: the
    whole program is one cuBLASLt FP8 GEMM (`__cublas$lt$matmul$f8`, what the fp8 policy's matmuls compile to) of the
    program's own parameters, the two scales among them; no Triton GEMM fusion, no transpose, no constant scale."""
    import functools

    import jax
    from jax.sharding import SingleDeviceSharding

    from shardkit.analysis.predicted.targets import parse_target, target_devices

    gpu_step = load_bench("gpu_step")
    on_h100 = SingleDeviceSharding(target_devices(parse_target("h100x1"))[0])
    fp8_cases = [case for case in gpu_step.gemm_cases("NVIDIA H100 80GB HBM3") if case.dtype == "fp8"]
    assert fp8_cases, "the H100 GEMM table has no FP8 entry to compile"
    for case in fp8_cases:
        operands = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_h100)
                    for x in jax.eval_shape(functools.partial(gpu_step.gemm_operands, case))]
        text = gpu_step.gemm_function(case).lower(*operands).compile().as_text()
        instructions = _entry_instructions(text)
        parameters = sorted((int(args[0]), name) for name, opcode, args, _ in instructions if opcode == "parameter")
        ops = [(opcode, args, _target_or_kind(line)) for _, opcode, args, line in instructions
               if opcode not in ("parameter", "get-tuple-element")]
        assert ops == [("custom-call", [name for _, name in parameters], "__cublas$lt$matmul$f8")], (case, ops)


def _target_or_kind(line: str) -> str | None:
    """A custom call's target or a fusion's backend kind (e.g. `__triton_nested_gemm_fusion`), from its HLO line."""
    import re

    found = re.search(r'custom_call_target="([^"]+)"|"kind":"([^"]+)"', line)
    return found and (found[1] or found[2])
