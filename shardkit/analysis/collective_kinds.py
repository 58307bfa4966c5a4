"""The kinds of collective XLA emits, as the optimized HLO names them, and how the analytic model's collectives are
matched against the compiled ones. Imports nothing from shardkit, so every analysis module may import it."""

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                    "collective-broadcast", "ragged-all-to-all")
REDUCTION_KINDS = ("all-reduce", "reduce-scatter")


def collective_family(kind: str) -> str:
    """How analytic and compiled collectives are matched: every reduction (all-reduce, reduce-scatter) is one
    family, since XLA:CPU writes a reduce-scatter as an all-reduce and a slice; other kinds are their own."""
    return "reduction" if kind in REDUCTION_KINDS else kind
