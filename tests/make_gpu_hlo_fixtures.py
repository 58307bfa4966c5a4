"""Save the optimized HLO of shardkit's 1b step as XLA:GPU compiles it on a real GPU (run once, on a GPU).

`tests/test_overlap.py` replays these files against the measured rows of `bench/results/gpu_step_h200_*`: a
deviceless `--target` compile does not give the same program (jax 0.10.2's XLA emits no asynchronous fusions, the
cause of the replay's 1.7-3.7x error on the H200 run), so the test reads what the GPU run itself compiled.

    python tests/make_gpu_hlo_fixtures.py none:4096 full:4096 selective:4096 minimal_with_context:4096 \
        none:8192 full:8192 minimal_with_context:8192

Each `REMAT:SEQ` compiles the step of `bench/gpu_step.py` (preset 1b, batch 4, bf16, cuDNN attention, one device,
shardkit's GPU flags) without running it and writes `tests/data/h200_hlo/1b_{REMAT}_{SEQ}x4.hlo.gz`. The checked-in
files come from one NVIDIA H200 with jax 0.11.2 (jax-cuda13-plugin 0.11.2), the versions of the measured rows.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "h200_hlo"


def fixture_path(remat: str, seq: int) -> Path:
    """Where the HLO of the 1b step at `remat`, `seq` x 4 is kept."""
    return OUT / f"1b_{remat}_{seq}x4.hlo.gz"


def main(cases: list[str]) -> None:
    import jax

    sys.path.insert(0, str(ROOT))
    from bench.gpu_step import Case, _recipe
    from shardkit.layout import build_layout
    from shardkit.step import build_step
    from shardkit.xla_flags import compile_lowered

    OUT.mkdir(parents=True, exist_ok=True)
    for remat, seq in (case.split(":") for case in cases):
        layout = build_layout(_recipe(Case("shardkit", "1b", remat, 4, int(seq), 5)), jax.devices()[:1])
        compiled = compile_lowered(build_step(layout).lower(), layout.recipe, layout.mesh)
        with gzip.open(fixture_path(remat, int(seq)), "wt") as out:
            out.write(compiled.as_text())
        print(f"{fixture_path(remat, int(seq))}: jax {jax.__version__} on {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main(sys.argv[1:])
