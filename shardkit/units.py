"""Sizes written by people: `8GB`, `80GiB`, `512M`, `1000000`, read the same way everywhere.

SI suffixes with a B (KB, MB, GB, TB) are decimal, as transformers' `max_shard_size` and disk vendors write them;
IEC suffixes (KiB, MiB, GiB, TiB) and bare letters (K, M, G, T, as XLA's flags and nccl-tests write them) are binary.
"""

from __future__ import annotations

import re

from shardkit.errors import ShardkitError

GIB = 2**30  # bytes in a GiB, the unit sizes are printed in

_SCALE = {"": 1, "b": 1,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}


def parse_size(text: str, field: str) -> int:
    """Bytes in a size such as `40GiB`, `5GB`, `512M` or `1000000` (fractions allowed: `1.5GiB`).

    Raises:
        ShardkitError: naming `field`, when the text is not a positive size.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if unit not in _SCALE or float(match.group(1)) <= 0:
        raise ShardkitError(field, f"expected a positive size such as 40GiB, 5GB, 512M or 1000000, got {text!r}")
    return int(float(match.group(1)) * _SCALE[unit])
