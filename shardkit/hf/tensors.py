"""Hugging Face Llama checkpoints: config.json <-> LlamaConfig, and tensor names and layouts <-> shardkit parameters.

Hugging Face's `LlamaForCausalLM` and models/llama.py compute the same function (same RMSNorm, rotary in the
split-halves `rotate_half` convention, grouped-query attention, SwiGLU, llama3 rope scaling), so a checkpoint maps
onto shardkit's parameters by renaming, transposing (torch's Linear stores (out, in)) and splitting the fused head
axis, with no permutation of the rotary dimensions:

    model.embed_tokens.weight                  (V, D)        embedding_VD
    model.layers.{l}.input_layernorm.weight    (D,)          blocks/attn_norm_D[l]
    model.layers.{l}.self_attn.q_proj.weight   (H*E, D)      blocks/attn/wq_DHE[l]    (transposed, split H x E)
    model.layers.{l}.self_attn.k_proj.weight   (K*E, D)      blocks/attn/wk_DKE[l]
    model.layers.{l}.self_attn.v_proj.weight   (K*E, D)      blocks/attn/wv_DKE[l]
    model.layers.{l}.self_attn.o_proj.weight   (D, H*E)      blocks/attn/wo_HED[l]
    model.layers.{l}.post_attention_layernorm  (D,)          blocks/mlp_norm_D[l]
    model.layers.{l}.mlp.gate_proj.weight      (F, D)        blocks/mlp/w_gate_DF[l]
    model.layers.{l}.mlp.up_proj.weight        (F, D)        blocks/mlp/w_up_DF[l]
    model.layers.{l}.mlp.down_proj.weight      (D, F)        blocks/mlp/w_down_FD[l]
    model.norm.weight                          (D,)          final_norm_D
    lm_head.weight                             (V, D)        head_DV (absent when the embeddings are tied)

Each mapping says which shardkit axes make the rows and which the columns of the Hugging Face matrix, so a device's
block of a shardkit parameter is read as one rectangle of each layer's matrix (`read_block`) and written back the same
way (`to_hf_matrix`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterator, Mapping

import ml_dtypes  # noqa: F401  registers numpy's bfloat16, which safetensors' numpy API returns
import numpy as np

from shardkit.errors import ShardkitError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors a checkpoint may carry that hold nothing shardkit needs (old transformers saved the rotary table).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The floating-point dtypes a Llama checkpoint is stored in (safetensors names them so).
SAFETENSORS_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One shardkit parameter <-> Hugging Face tensor(s). `name` has `{}` for the layer of stacked parameters;
    `rows` / `cols` are the shardkit axes (the layer axis excluded) that flatten, outer to inner, into the Hugging
    Face tensor's first / second axis."""

    path: str
    name: str
    rows: tuple[int, ...]
    cols: tuple[int, ...] = ()

    @property
    def stacked(self) -> bool:
        return "{}" in self.name


def tensor_maps(tie_embeddings: bool) -> list[TensorMap]:
    """Every parameter of models/llama.py with its Hugging Face tensor."""
    layer = "model.layers.{}."
    maps = [
        TensorMap("embedding_VD", "model.embed_tokens.weight", (0,), (1,)),
        TensorMap("final_norm_D", "model.norm.weight", (0,)),
        TensorMap("blocks/attn_norm_D", layer + "input_layernorm.weight", (0,)),
        TensorMap("blocks/mlp_norm_D", layer + "post_attention_layernorm.weight", (0,)),
        TensorMap("blocks/attn/wq_DHE", layer + "self_attn.q_proj.weight", (1, 2), (0,)),
        TensorMap("blocks/attn/wk_DKE", layer + "self_attn.k_proj.weight", (1, 2), (0,)),
        TensorMap("blocks/attn/wv_DKE", layer + "self_attn.v_proj.weight", (1, 2), (0,)),
        TensorMap("blocks/attn/wo_HED", layer + "self_attn.o_proj.weight", (2,), (0, 1)),
        TensorMap("blocks/mlp/w_gate_DF", layer + "mlp.gate_proj.weight", (1,), (0,)),
        TensorMap("blocks/mlp/w_up_DF", layer + "mlp.up_proj.weight", (1,), (0,)),
        TensorMap("blocks/mlp/w_down_FD", layer + "mlp.down_proj.weight", (1,), (0,)),
    ]
    if not tie_embeddings:
        maps.append(TensorMap("head_DV", "lm_head.weight", (1,), (0,)))
    return maps


def hf_names(tensor_map: TensorMap, layers: int) -> list[str]:
    return [tensor_map.name.format(layer) for layer in range(layers)] if tensor_map.stacked else [tensor_map.name]


def hf_shape(tensor_map: TensorMap, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face tensor's shape for a (per-layer) shardkit shape."""
    groups = (tensor_map.rows, tensor_map.cols) if tensor_map.cols else (tensor_map.rows,)
    return tuple(math.prod(shape[axis] for axis in group) for group in groups)


# ---- blocks: shardkit slice <-> Hugging Face rectangle ---------------------------------------------------------------
def read_block(tensor: np.ndarray, tensor_map: TensorMap, shape: tuple[int, ...], index: tuple[slice, ...]):
    """Block `index` of the shardkit parameter (per-layer `shape`) from its Hugging Face matrix `tensor`.

    Only the rectangle covering the block is read (a memory map reads only those pages): along each Hugging Face axis,
    the range of the outermost shardkit axis's slice with the inner axes whole, then the inner axes are sliced.
    """
    groups = [tensor_map.rows] + ([tensor_map.cols] if tensor_map.cols else [])
    ranges, split_shape, inner = [], [], []
    for group in groups:
        outer = index[group[0]].indices(shape[group[0]])
        width = math.prod(shape[axis] for axis in group[1:])
        ranges.append(slice(outer[0] * width, outer[1] * width))
        split_shape += [outer[1] - outer[0]] + [shape[axis] for axis in group[1:]]
        inner += [slice(None)] + [index[axis] for axis in group[1:]]
    block = np.asarray(tensor[tuple(ranges)]).reshape(split_shape)[tuple(inner)]
    order = [axis for group in groups for axis in group]
    return block.transpose([order.index(axis) for axis in range(len(shape))])


def to_hf_matrix(array: np.ndarray, tensor_map: TensorMap) -> np.ndarray:
    """The inverse of `read_block` on a whole (per-layer) parameter: its Hugging Face tensor."""
    order = list(tensor_map.rows) + list(tensor_map.cols)
    return np.ascontiguousarray(array.transpose(order).reshape(hf_shape(tensor_map, array.shape)))


# ---- safetensors, read lazily ----------------------------------------------------------------------------------------
class SafetensorsDir:
    """The tensors of a `save_pretrained` directory (one file, or shards listed by the index), read lazily.

    Each file is opened once with the safetensors library (`safe_open`), which maps it; `tensor(name)[rows, cols]`
    reads only the bytes of that rectangle. bf16, the dtype most Llama checkpoints are stored in, comes back as
    ml_dtypes' bfloat16 (the import of ml_dtypes above registers it with numpy, which safetensors' numpy API needs).
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.files = _weight_files(directory)
        self.handles = {file: _open(file) for file in sorted(set(self.files.values()))}
        self.owner: dict[str, Path] = {}
        for file, handle in self.handles.items():
            for name in handle.keys():
                self.owner[name] = file

    def names(self) -> set[str]:
        return set(self.owner)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def tensor(self, name: str):
        """The tensor as a lazy slice: index it (`[a:b, c:d]`, `[:]`) to read that part as a numpy array."""
        tensor = self._slice(name)
        if tensor.get_dtype() not in SAFETENSORS_DTYPES:
            field = f"{self.owner[name].name}:{name}"
            raise ShardkitError(field, f"dtype {tensor.get_dtype()} is not one of {list(SAFETENSORS_DTYPES)}")
        return tensor

    def read(self, name: str) -> np.ndarray:
        """The whole tensor as a numpy array."""
        return self.tensor(name)[:]

    def _slice(self, name: str):
        return self.handles[self.owner[name]].get_slice(name)


def _open(file: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="numpy")
    except SafetensorError as err:
        raise ShardkitError(file.name, f"is not a safetensors file ({err})") from None


def _weight_files(directory: Path) -> dict[str, Path]:
    """{tensor name: file} from the index, or {"*": model.safetensors}."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ShardkitError(INDEX_FILE, "has no weight_map table")
        missing = sorted({file for file in weight_map.values() if not (directory / file).is_file()})
        if missing:
            raise ShardkitError(INDEX_FILE, f"lists {missing[0]}, which is not in {directory}")
        return {name: directory / file for name, file in weight_map.items()}
    if (directory / SINGLE_FILE).is_file():
        return {"*": directory / SINGLE_FILE}
    raise ShardkitError("HF_DIR", f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors is read)")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ShardkitError(path.name, f"cannot be read as JSON: {err}") from None
    if not isinstance(value, dict):
        raise ShardkitError(path.name, "must hold a JSON object")
    return value


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write `tensors` as one safetensors file (metadata format "pt", which transformers expects)."""
    from safetensors.numpy import save_file

    save_file({name: np.ascontiguousarray(array) for name, array in tensors.items()}, str(path), {"format": "pt"})


def iter_tensors(sizes: Mapping[str, int], shard_bytes: int) -> Iterator[list[str]]:
    """Tensor names grouped into files of at most `shard_bytes` (a tensor larger than that gets a file of its own)."""
    group, total = [], 0
    for name, size in sizes.items():
        if group and total + size > shard_bytes:
            yield group
            group, total = [], 0
        group.append(name)
        total += size
    if group:
        yield group


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ShardkitError("HF_DIR", f"{directory} has no {CONFIG_FILE}; pass a Hugging Face model directory")
    return _read_json(path)


