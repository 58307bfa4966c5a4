"""The physical mesh axes: the names every layout, rule table and hand-written collective refers to.

This module sits at the bottom of the import graph: it imports nothing, so anything may import it.
"""

PIPELINE = "pipeline"  # pipeline stages
DATA = "data"  # data-parallel replicas (ZeRO-1/2 shard over it)
FSDP = "fsdp"  # FSDP (ZeRO-3) shards of the parameters
EXPERT = "expert"  # expert-parallel ranks
SEQUENCE = "sequence"  # context-parallel ranks
TENSOR = "tensor"  # Megatron tensor-parallel ranks

MESH_AXES = (PIPELINE, DATA, FSDP, EXPERT, SEQUENCE, TENSOR)  # the mesh's axis order, outermost first
