"""Run layouts on N fake CPU devices in a process of their own and hold each equal to one device (fp32).

    python -m tests.five_d_worker DEVICES CASES_JSON

CASES_JSON: a list of [recipe name, [overrides...]]. Each case's losses over a few steps and its first-batch gradients
are compared with one device's (`tests.equivalence.assert_traces_close`, fp32 tolerance): the same recipe and
overrides with every mesh axis at 1. Prints one line per case ("ok NAME" or the failure) and
exits 1 if any case failed. tests/test_five_d.py starts it, so that a count other than the suite's 8 devices can be
used.
"""

from __future__ import annotations

import json
import sys

from shardkit.testing import use_test_devices

STEPS = 3


def main(devices: int, cases: list) -> int:
    use_test_devices(devices)
    import jax

    from shardkit.axes import MESH_AXES
    from tests.equivalence import FP32_RTOL, assert_traces_close, trace
    from tests.helpers import recipe

    references, failed = {}, 0
    for name, overrides in cases:
        label = " ".join([name, *overrides])
        kept = (name, *(o for o in overrides if not o.startswith(("mesh.", "pipeline."))))
        if kept not in references:
            one_device = recipe(name, *overrides, *(f"mesh.{axis}=1" for axis in MESH_AXES))
            references[kept] = trace(one_device, steps=STEPS, devices=jax.devices()[:1])
        try:
            assert_traces_close(trace(recipe(name, *overrides), steps=STEPS), references[kept], FP32_RTOL)
            print(f"ok {label}", flush=True)
        except AssertionError as error:
            failed += 1
            print(f"FAILED {label}: {error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), json.loads(sys.argv[2])))
