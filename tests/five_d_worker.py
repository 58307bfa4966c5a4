"""Run layouts on N fake CPU devices in a process of their own and hold each equal to one device (fp32).

    python -m tests.five_d_worker DEVICES CASES_JSON

CASES_JSON: a list of [recipe name, [overrides...]]. Each case's losses over a few steps, its first-batch gradients
and, for a mixture of experts, each step's router metrics (balance and z losses, expert loads, the dropped share of
choices) are compared with one device's (`tests.equivalence.assert_traces_close`, fp32 tolerance; the gradients are
read back from the first step, so each layout compiles two programs, evaluation and the step). The reference: the same
recipe and overrides with every mesh axis at 1, the whole batch in one pass, and no pipeline or context-mode
overrides (one device has no pipeline and no sequence ranks to run attention across), so cases that differ only in
those share one reference. Prints one line per case ("ok NAME" or the failure) and exits 1 if any case failed.
tests/test_five_d.py starts it, so that a count other than the suite's 8 devices can be used.
"""

from __future__ import annotations

import json
import sys

from shardkit.testing import use_test_devices

STEPS = 2
# Overrides the one-device reference leaves out.
NOT_ON_ONE_DEVICE = ("mesh.", "pipeline.", "train.grad_accum=", "train.context=")


def main(devices: int, cases: list) -> int:
    use_test_devices(devices)
    import jax

    from shardkit.axes import MESH_AXES
    from tests.equivalence import FP32_RTOL, assert_traces_close, trace
    from tests.helpers import recipe

    references, failed = {}, 0
    for name, overrides in cases:
        label = " ".join([name, *overrides])
        kept = (name, *(o for o in overrides if not o.startswith(NOT_ON_ONE_DEVICE)))
        if kept not in references:
            one_device = recipe(*kept, *(f"mesh.{axis}=1" for axis in MESH_AXES))
            references[kept] = trace(one_device, steps=STEPS, devices=jax.devices()[:1])
        try:
            got = trace(recipe(name, *overrides), steps=STEPS)
            assert_traces_close(got, references[kept], FP32_RTOL)
            assert_moe_metrics_close(got.moe_metrics, references[kept].moe_metrics, FP32_RTOL)
            print(f"ok {label}", flush=True)
        except AssertionError as error:
            failed += 1
            print(f"FAILED {label}: {error}", flush=True)
    return 1 if failed else 0


def assert_moe_metrics_close(got: tuple, want: tuple, rtol: float) -> None:
    """Each step's router metrics within `rtol` (relative; the dropped share also absolutely, it may be 0)."""
    import numpy as np

    assert [sorted(step) for step in got] == [sorted(step) for step in want], (got, want)
    for got_step, want_step in zip(got, want):
        for key, value in want_step.items():
            np.testing.assert_allclose(got_step[key], value, rtol=rtol, atol=rtol * 1e-3, err_msg=key)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), json.loads(sys.argv[2])))
