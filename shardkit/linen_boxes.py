"""Linen's partitioning boxes, unboxed without their sharding constraint while shardkit traces a forward pass.

A bridged Linen module (`nnx.bridge.ToNNX`) gets its parameters back in the boxes its initializers wrote
(`nn.with_partitioning`, `nn.with_logical_partitioning`), and Flax unboxes each under a sharding constraint whenever a
mesh is in context, as shardkit's forward has one (so that Flax's activation constraints, `with_logical_constraint`,
follow the recipe). Those parameter constraints would fight the layout: the recipe has placed every parameter already
(by its names, or by a `[rules.paths]` entry that overrides them), the authors' names may be mesh axes of their own
mesh, and Linen checks each stored parameter's shape by re-running its initializer, where `DenseGeneral` unboxes a
flat (2-D) kernel under the stored kernel's three names. Flax offers no switch for parameter constraints alone, so
`unconstrained_boxes` swaps the two box classes' `unbox` for one that returns the value, for the duration.
"""

from __future__ import annotations

import contextlib
import threading

from flax.core import meta
from flax.linen import spmd

BOX_CLASSES = (meta.Partitioned, spmd.LogicallyPartitioned)
_lock = threading.RLock()
_depth = [0]
_originals: dict[type, object] = {}


def _plain_unbox(self, apply_constraint: bool = True):
    """A box's value as stored: shardkit's shardings place it."""
    del apply_constraint
    return self.value


@contextlib.contextmanager
def unconstrained_boxes():
    """Within: Linen's partitioning boxes unbox to their value, constraining nothing (re-entrant)."""
    with _lock:
        if _depth[0] == 0:
            for cls in BOX_CLASSES:
                _originals[cls] = cls.__dict__["unbox"]
                cls.unbox = _plain_unbox
        _depth[0] += 1
    try:
        yield
    finally:
        with _lock:
            _depth[0] -= 1
            if _depth[0] == 0:
                for cls in BOX_CLASSES:
                    cls.unbox = _originals.pop(cls)
