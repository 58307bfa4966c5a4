"""tests/equivalence.py reads a trace's first-batch gradients back from the optimizer state after the first step
(AdamW's first moment, the clip undone) instead of compiling the gradients separately: held here to the separately
compiled `gradients` program, on a layout whose gradient norm passes the clip (so undoing it is exercised), within
1e-6 of each leaf's largest entry: ten times tighter than FP32_RTOL, which every equivalence test holds them to."""

from __future__ import annotations

import numpy as np

from tests.equivalence import flatten, trace
from tests.helpers import recipe


def test_gradients_read_from_the_first_step_are_the_compiled_gradients():
    got = trace(recipe("fsdp"), steps=1)
    assert got.first_moment, "the fp32 fsdp recipe's gradients should come from its first step"
    assert got.first_moment[1] > 1.0, "the clip is not exercised: pick a layout whose first gradient norm exceeds 1"
    compiled = flatten(got.gradients(got.first_params, got.first_batch, np.float32(1))[1])
    assert compiled.keys() == got.grads.keys()
    for path, want in compiled.items():
        np.testing.assert_allclose(got.grads[path], want, rtol=0, atol=1e-6 * np.abs(want).max(), err_msg=path)
