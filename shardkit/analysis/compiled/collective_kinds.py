"""The kinds of collective XLA emits, as the optimized HLO names them, and how the analytic model's collectives are
matched against the compiled ones. Imports nothing from shardkit, so every analysis module may import it."""

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                    "collective-broadcast", "ragged-all-to-all")
REDUCTION_KINDS = ("all-reduce", "reduce-scatter")
# Ring algorithms: bytes one device sends per byte of the op's full buffer, for a group of n devices.
RING_FACTORS = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
    "collective-broadcast": lambda n: 1.0,
}


def collective_family(kind: str) -> str:
    """How analytic and compiled collectives are matched: every reduction (all-reduce, reduce-scatter) is one
    family, since XLA:CPU writes a reduce-scatter as an all-reduce and a slice; other kinds are their own."""
    return "reduction" if kind in REDUCTION_KINDS else kind
