"""Recipes: one TOML file per parallel layout, loaded into frozen, validated dataclasses.

A recipe states only what differs from the defaults below. Every section's keys are checked against its dataclass:
an unknown key, a value of the wrong type or an impossible value is a `ShardkitError` naming `section.key`.
Command-line overrides (`--set section.key=value`) are applied to the raw TOML tables before validation, so they are
checked exactly like keys written in the file.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import tomli_w

from shardkit.axes import MESH_AXES
from shardkit.errors import ShardkitError

# Outermost to innermost in the device order. `expert` (expert parallelism, shardkit/moe.py) sits inside the
# data-parallel axes, whose batch it also splits, and outside `sequence` and `tensor`.
REMAT_POLICIES = ("none", "full", "selective", "minimal_with_context", "offload")  # see shardkit/remat.py
ATTENTION_MODES = ("auto", "cudnn", "xla")  # see shardkit/attention/kernel.py `choose_kernel`
PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble")
# When FSDP inside a pipeline gathers a stage's weights (shardkit/pipeline/config.py): once per step, or at every use.
PIPELINE_FSDP_GATHERS = ("per_step", "per_use")
DATA_SOURCES = ("synthetic", "text", "bin")
PACKING_MODES = ("none", "documents")  # see shardkit/data/packing.py
# When FSDP gathers parameters and reduces gradients under gradient accumulation (see TrainSection).
FSDP_SYNC_MODES = ("per_microbatch", "per_step")
CONTEXT_MODES = ("ring", "allgather")  # how attention runs when mesh.sequence > 1 (shardkit.attention.ring)
WANDB_MODES = ("online", "offline")
GRAD_REDUCE_MODES = ("compute", "float32")  # the dtype the layers' gradients cross devices in (PrecisionSection)
RUN_RECIPE = "recipe.toml"  # the resolved recipe in a run directory (written by `train` and `import-hf`)


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which model and at what size. `dims` holds per-dimension overrides by logical name (`layers=4`)."""

    name: str = "llama"
    preset: str = "tiny"
    dims: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Sizes of the physical mesh axes; absent means 1, and at most one may be -1 ("the rest of the devices")."""

    pipeline: int = 1
    data: int = 1
    fsdp: int = 1
    expert: int = 1
    sequence: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            size = getattr(self, axis)
            if size == 0 or size < -1:
                raise ShardkitError(f"mesh.{axis}", f"size must be a positive integer or -1 (the rest), got {size}")
        wildcards = [axis for axis in MESH_AXES if getattr(self, axis) == -1]
        if len(wildcards) > 1:
            raise ShardkitError(f"mesh.{wildcards[1]}", f"only one axis may be -1, but {wildcards} all are")

    def sizes(self) -> dict[str, int]:
        """Axis name -> size as written (one may still be -1)."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}


UNNAMED_MODES = ("replicate", "refuse")  # rules.unnamed: a parameter no name reaches is replicated, or refused


@dataclasses.dataclass(frozen=True)
class RulesSection:
    """Logical-name -> mesh-axis rules: intent-level shorthands, then raw per-table overrides.

    `fsdp = "embed"` says "parameters are sharded over the fsdp axis along `embed`"; `tensor = ["heads", "mlp"]` says
    those names (and only those) go to the tensor axis. `params` and `activations` are the raw escape hatch, one entry
    per logical name. `zero` is the ZeRO stage for the data axis: 1 shards the optimizer state, 2 also the gradients.
    `paths` names parameters by path (regular expression, in file order -> one logical name per dimension, "" for
    none), ahead of the model's own names; `unnamed` says what happens to a parameter named by neither: `replicate`
    (as Flax's `nn.get_sharding`) or `refuse`.
    """

    data: tuple[str, ...] | None = None
    fsdp: tuple[str, ...] | None = None
    expert: tuple[str, ...] | None = None
    tensor: tuple[str, ...] | None = None
    sequence: tuple[str, ...] | None = None
    pipeline: tuple[str, ...] | None = None
    zero: int = 0
    params: tuple[tuple[str, tuple[str, ...]], ...] = ()
    activations: tuple[tuple[str, tuple[str, ...]], ...] = ()
    paths: tuple[tuple[str, tuple[str, ...]], ...] = ()
    unnamed: str = "replicate"

    def __post_init__(self):
        if self.zero not in (0, 1, 2):
            raise ShardkitError("rules.zero", f"must be 0, 1 or 2 (ZeRO-3 is the fsdp mesh axis), got {self.zero}")
        if self.unnamed not in UNNAMED_MODES:
            raise ShardkitError("rules.unnamed", f"must be one of {list(UNNAMED_MODES)}, got {self.unnamed!r}")


@dataclasses.dataclass(frozen=True)
class PrecisionSection:
    """`policy`: a preset (`float32`, `bf16`, `bf16-params`, `fp16`, `fp8`) or a jmp-style string.

    `grad_reduce`: the dtype the layers' weight gradients are reduced across devices in. `compute` (default): the
    compute dtype, what autodiff of the cast parameters gives. `float32`: the weight-gradient matmuls of
    `shardkit.nn.dot` produce fp32, so the partial sums cross devices in fp32 and are rounded to the compute dtype
    once, after the sum (`shardkit.precision.Policy.grad_reduce_dtype`). Not with the fp8 policy (its weight gradient
    is an FP8 GEMM) or a model with no `shardkit.nn.dot` (such as one of `nnx.Linear` layers):
    `shardkit.layout.check_grad_reduce`. Pipelines sum and reduce their stage gradients in it themselves.
    """

    policy: str = "float32"
    grad_reduce: str = "compute"
    loss_scale_init: float = 2.0**15
    loss_scale_period: int = 200

    @functools.cached_property
    def parsed(self):
        """The policy as a `shardkit.precision.Policy`: parsed once, read by the layout and everything else."""
        from shardkit.precision import parse_policy  # here, so that reading a recipe (--help, show) needs no JAX

        return dataclasses.replace(parse_policy(self.policy), grad_reduce_fp32=self.grad_reduce == "float32")

    def __post_init__(self):
        if self.grad_reduce not in GRAD_REDUCE_MODES:
            raise ShardkitError("precision.grad_reduce", f"must be one of {list(GRAD_REDUCE_MODES)}, got "
                                f"{self.grad_reduce!r}")
        self.parsed  # noqa: B018  parsed once, here: a ShardkitError naming precision.policy when it cannot be
        if self.parsed.fp8 and self.parsed.grad_reduce_fp32:
            raise ShardkitError("precision.grad_reduce", "'float32' cannot apply under the fp8 policy (its weight "
                                "gradients are FP8 GEMMs returning the compute dtype); use 'compute' or policy 'bf16'")
        if self.loss_scale_init <= 0 or self.loss_scale_period < 1:
            raise ShardkitError("precision", "loss_scale_init must be > 0 and loss_scale_period >= 1")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """The step. `fsdp_sync` says when FSDP talks to the other shards under `grad_accum` > 1 (no effect otherwise):

    - `per_microbatch` (default): parameters all-gathered layer by layer and gradients reduce-scattered inside every
      micro-batch, so no device ever holds more than one layer's gathered parameters (what FSDP is for), at
      `grad_accum` times the parameter traffic.
    - `per_step`: parameters gathered once before the micro-batch loop and the accumulated gradients reduced once
      after it, like data parallelism. Costs, per device, for the whole step: a gathered copy of the parameters
      (parameter dtype, divided only by tensor/pipeline) and an unreduced fp32 gradient buffer of the same size.
      Worth it when that fits and the repeated gathers would not hide behind compute. Each fsdp replica then
      draws its own dropout masks, as data-parallel replicas do under accumulation. Under a GPipe or circular
      pipeline the stage weights are gathered once per step (per data replica) and every pass takes that copy
      (shardkit/pipeline/held.py); the 1F1B family gathers per pass and refuses it.

    The default stays per micro-batch because memory is what FSDP is chosen for; per-step is the explicit trade.

    `context` says how attention runs when mesh.sequence > 1 (shardkit.attention.ring): `allgather` (default: K/V
    all-gathered once per layer, fewer and larger messages; K/V of the whole sequence on every device) or `ring`
    (K/V blocks passed around the ring, O(s / cp) K/V per device: for the longest sequences). bench/results/
    context_ring_vs_allgather_h100x8_*.md holds the compiled figures behind the default.
    `attention` picks the attention kernel: `auto` (cuDNN's fused attention where it can run, XLA's elsewhere),
    `cudnn` (an error where it cannot run) or `xla`; shardkit/attention/kernel.py holds what cuDNN accepts.
    """

    steps: int = 40
    global_batch: int = 16
    seq_len: int = 64
    grad_accum: int = 1
    remat: str = "none"
    seed: int = 0
    dropout: float = 0.0
    fsdp_sync: str = "per_microbatch"
    context: str = "allgather"
    attention: str = "auto"

    def __post_init__(self):
        for name in ("steps", "global_batch", "seq_len", "grad_accum"):
            if getattr(self, name) < 1:
                raise ShardkitError(f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.remat not in REMAT_POLICIES:
            raise ShardkitError("train.remat", f"must be one of {list(REMAT_POLICIES)}, got {self.remat!r}")
        if self.global_batch % self.grad_accum:
            raise ShardkitError(
                "train.grad_accum",
                f"global_batch {self.global_batch} is not divisible by grad_accum {self.grad_accum}",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ShardkitError("train.dropout", f"must be in [0, 1), got {self.dropout}")
        if self.fsdp_sync not in FSDP_SYNC_MODES:
            raise ShardkitError("train.fsdp_sync", f"must be one of {list(FSDP_SYNC_MODES)}, got {self.fsdp_sync!r}")
        if self.context not in CONTEXT_MODES:
            raise ShardkitError("train.context", f"must be one of {list(CONTEXT_MODES)}, got {self.context!r}")
        if self.attention not in ATTENTION_MODES:
            raise ShardkitError("train.attention", f"must be one of {list(ATTENTION_MODES)}, got {self.attention!r}")


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """AdamW with linear warmup and cosine decay to `lr * min_lr_ratio`, clipped by global norm.

    A field left None is unset: the model preset's default fills it (`shardkit.optimizer.optimizer_settings`), so a
    value the recipe or `--set` gives always wins over the preset's.
    """

    lr: float | None = None
    warmup: int | None = None
    min_lr_ratio: float | None = None
    weight_decay: float | None = None
    b1: float | None = None
    b2: float | None = None
    eps: float | None = None
    clip: float | None = None

    def __post_init__(self):
        if self.lr is not None and self.lr <= 0:
            raise ShardkitError("optimizer.lr", f"must be > 0, got {self.lr}")
        if self.warmup is not None and self.warmup < 0:
            raise ShardkitError("optimizer.warmup", f"must be >= 0, got {self.warmup}")

    def given(self) -> dict[str, Any]:
        """The fields set (not None), by name."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


@dataclasses.dataclass(frozen=True)
class DataSection:
    """`synthetic` (learnable, generated), `text` (a UTF-8 file read as bytes) or `bin` (memory-mapped tokens).

    `packing = "documents"`: rows are cut from the token stream as with "none", and attention and rotary positions
    stop at each end-of-document token, `eos_id` (default: the one in the prepared dataset's meta.json).
    """

    source: str = "synthetic"
    path: str = ""
    dtype: str = "uint16"
    packing: str = "none"
    eos_id: int | None = None

    def __post_init__(self):
        if self.source not in DATA_SOURCES:
            raise ShardkitError("data.source", f"must be one of {list(DATA_SOURCES)}, got {self.source!r}")
        if self.source != "synthetic" and not self.path:
            raise ShardkitError("data.path", f"data.source={self.source!r} needs a file path")
        if self.dtype not in ("uint16", "uint32"):
            raise ShardkitError("data.dtype", f"must be 'uint16' or 'uint32', got {self.dtype!r}")
        if self.packing not in PACKING_MODES:
            raise ShardkitError("data.packing", f"must be one of {list(PACKING_MODES)}, got {self.packing!r}")
        if self.eos_id is not None and self.eos_id < 0:
            raise ShardkitError("data.eos_id", f"must be a token id >= 0, got {self.eos_id}")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Save every `every` steps and every `every_minutes` of training (0: neither; always at the end and on
    preemption), keeping the newest `keep`. The time is process 0's clock, agreed by all processes before a step."""

    every: int = 0
    every_minutes: float = 15.0
    keep: int = 2

    def __post_init__(self):
        if self.every < 0:
            raise ShardkitError("checkpoint.every", f"must be >= 0, got {self.every}")
        if self.every_minutes < 0:
            raise ShardkitError("checkpoint.every_minutes", f"must be >= 0 (0: no saves by time), got "
                                f"{self.every_minutes}")
        if self.keep < 1:
            raise ShardkitError("checkpoint.keep", f"must be >= 1, got {self.keep}")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation every `every` steps and after the last (0: never), the mean loss over `batches` fixed
    batches of train.global_batch rows. `path`: a token .bin to evaluate on (default: the `val` split that
    `shardkit data prepare` wrote beside data.path, else the training source). See shardkit/run/evaluate.py."""

    every: int = 0
    batches: int = 4
    path: str = ""

    def __post_init__(self):
        if self.every < 0:
            raise ShardkitError("eval.every", f"must be >= 0, got {self.every}")
        if self.batches < 1:
            raise ShardkitError("eval.batches", f"must be >= 1, got {self.batches}")


@dataclasses.dataclass(frozen=True)
class PipelineSection:
    """`fsdp_gather`: `per_step` (default) gathers each stage's FSDP-sharded weights once before the tick loop and
    reduce-scatters their gradient once after it (MaxText's `pipeline_fsdp_ag_once`), holding the stage's gathered
    weights for the step; `per_use` leaves FSDP to XLA inside the loop, gathering for every micro-batch, forward and
    backward, and holding one layer's gathered weights at a time."""

    microbatches: int = 4
    repeats: int = 1
    schedule: str = "gpipe"
    fsdp_gather: str = "per_step"

    def __post_init__(self):
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ShardkitError("pipeline.schedule", f"must be one of {list(PIPELINE_SCHEDULES)}, got "
                                                     f"{self.schedule!r}")
        if self.fsdp_gather not in PIPELINE_FSDP_GATHERS:
            raise ShardkitError("pipeline.fsdp_gather", f"must be one of {list(PIPELINE_FSDP_GATHERS)}, got "
                                f"{self.fsdp_gather!r}")
        for name in ("microbatches", "repeats"):
            if getattr(self, name) < 1:
                raise ShardkitError(f"pipeline.{name}", f"must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class XlaSection:
    """XLA flags for GPU compiles (`shardkit.xla_flags`): `flags` in XLA_FLAGS form over shardkit's GPU defaults,
    e.g. `flags = ["--xla_gpu_enable_latency_hiding_scheduler=true"]`; `gpu_defaults = false` drops the defaults."""

    flags: tuple[str, ...] = ()
    gpu_defaults: bool = True

    def __post_init__(self):
        from shardkit.xla_flags import parse_flags  # raises a ShardkitError naming xla.flags

        parse_flags(self.flags)


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """Where each step's metrics go besides `metrics.jsonl` (shardkit.run.metrics), written by process 0 only.

    `tensorboard`: event files under the run directory's `tensorboard/` (tensorboardX, no TensorFlow needed).
    `wandb`: a Weights & Biases run in `wandb_project`; `wandb_mode = "offline"` writes it under the run directory
    without a network, for `wandb sync` later. `async_metrics`: a step's metrics are fetched from the device on a
    background thread while the next steps run, instead of the loop waiting for each (docs/guide/logging.md).
    """

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "shardkit"
    wandb_mode: str = "online"
    async_metrics: bool = True

    def __post_init__(self):
        if self.wandb_mode not in WANDB_MODES:
            raise ShardkitError("logging.wandb_mode", f"must be one of {list(WANDB_MODES)}, got {self.wandb_mode!r}")
        if not self.wandb_project:
            raise ShardkitError("logging.wandb_project", "must be a non-empty project name")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A whole parallel layout. Build it with `load_recipe`; `raw` keeps the validated tables for checkpoints."""

    name: str = "recipe"
    model: ModelSection = ModelSection()
    mesh: MeshSection = MeshSection()
    rules: RulesSection = RulesSection()
    precision: PrecisionSection = PrecisionSection()
    train: TrainSection = TrainSection()
    optimizer: OptimizerSection = OptimizerSection()
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    pipeline: PipelineSection = PipelineSection()
    eval: EvalSection = EvalSection()
    xla: XlaSection = XlaSection()
    logging: LoggingSection = LoggingSection()
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)


SECTIONS: dict[str, type] = {
    field.name: field.type if isinstance(field.type, type) else globals()[field.type]
    for field in dataclasses.fields(Recipe)
    if field.name not in ("name", "raw")
}


def builtin_recipes() -> dict[str, Path]:
    """The recipes shipped inside the package (shardkit/recipes/*.toml), by name."""
    folder = Path(__file__).resolve().parent / "recipes"
    return {path.stem: path for path in sorted(folder.glob("*.toml"))}


def recipe_summary(path: Path) -> str:
    """A recipe's description: the first sentence, whole, of the comment paragraph after the command that runs it
    (a sentence may run over several comment lines)."""
    lines = []
    for line in path.read_text().splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#") or (not text and lines):
            break
        if text and not text.startswith("shardkit "):
            lines.append(text)
    paragraph = " ".join(lines)
    end = re.search(r"\.(\s|$)", paragraph)
    return paragraph[: end.start() + 1] if end else paragraph


def recipe_path(name_or_path: str | Path) -> Path:
    """A recipe file: the path itself when it exists, else the built-in recipe of that name (`fsdp`, `fsdp_tp`).

    Raises:
        ShardkitError: neither a file nor a built-in name.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    builtin = builtin_recipes()
    if str(name_or_path) in builtin:
        return builtin[str(name_or_path)]
    raise ShardkitError("recipe", f"no recipe file at {str(path)!r} and no built-in recipe of that name; pass a "
                        f"path such as recipes/fsdp.toml or a name among {sorted(builtin)} (see shardkit recipes)")


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a recipe file (or a built-in recipe by name), apply `section.key=value` overrides, validate everything.

    Raises:
        ShardkitError: the file is missing or malformed, or a key, type or value is invalid.
    """
    path = recipe_path(path)
    try:
        tables = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ShardkitError("recipe", f"{path} is not valid TOML: {err}") from None
    for override in overrides:
        apply_override(tables, override)
    return recipe_from_tables(tables, name=path.stem)


def recipe_from_tables(tables: Mapping[str, Any], name: str = "recipe") -> Recipe:
    """Validate parsed TOML tables into a `Recipe`."""
    unknown = sorted(set(tables) - set(SECTIONS))
    if unknown:
        raise ShardkitError(unknown[0], f"unknown recipe section; valid sections are {sorted(SECTIONS)}")
    sections = {}
    for section, cls in SECTIONS.items():
        table = tables.get(section, {})
        if not isinstance(table, dict):
            raise ShardkitError(section, f"must be a table ([{section}]), got {type(table).__name__}")
        sections[section] = _build_section(section, cls, table)
    return Recipe(name=name, raw=_freeze(tables), **sections)


def apply_override(tables: dict, override: str) -> None:
    """Apply one `section.key=value` override in place. The value is read as TOML, falling back to a bare string."""
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ShardkitError("--set", f"expected section.key=value (e.g. train.steps=10), got {override!r}")
    table = tables
    for part in parts[:-1]:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ShardkitError(f"--set {key}", f"{part!r} is a value, not a table")
    table[parts[-1]] = _parse_value(text.strip())


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _build_section(section: str, cls: type, table: Mapping[str, Any]):
    if section == "model":
        return _build_model_section(table)
    if section == "rules":
        return _build_rules_section(table)
    hints = _field_types(cls)
    kwargs = {}
    for key, value in table.items():
        if key not in hints:
            valid = [f.name for f in dataclasses.fields(cls)]
            raise ShardkitError(f"{section}.{key}", f"unknown key; valid keys are {valid}")
        kwargs[key] = _check_type(f"{section}.{key}", value, hints[key])
    return cls(**kwargs)


@functools.cache
def _field_types(cls: type) -> Mapping[str, Any]:
    """A section's field types, resolved once per class (`suggest` builds a recipe for every layout it prices)."""
    return types.MappingProxyType(typing.get_type_hints(cls))


def _build_model_section(table: Mapping[str, Any]) -> ModelSection:
    name = _check_type("model.name", table.get("name", ModelSection.name), str)
    preset = _check_type("model.preset", table.get("preset", ModelSection.preset), str)
    dims = tuple(sorted((key, value) for key, value in table.items() if key not in ("name", "preset")))
    for key, value in dims:
        if isinstance(value, float) and not math.isfinite(value):
            raise ShardkitError(f"model.{key}", f"must be a finite number, got {value}")
    return ModelSection(name=name, preset=preset, dims=dims)  # dims are checked against the model's config


def _build_rules_section(table: Mapping[str, Any]) -> RulesSection:
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key in MESH_AXES:
            kwargs[key] = _names(f"rules.{key}", value)
        elif key == "zero":
            kwargs[key] = _check_type("rules.zero", value, int)
        elif key == "unnamed":
            kwargs[key] = _check_type("rules.unnamed", value, str)
        elif key == "paths":
            kwargs[key] = _path_rules(value)
        elif key in ("params", "activations"):
            if not isinstance(value, dict):
                raise ShardkitError(f"rules.{key}", "must be a table of logical name -> mesh axis or list of axes")
            kwargs[key] = tuple(sorted((name, _names(f"rules.{key}.{name}", axes)) for name, axes in value.items()))
        else:
            valid = list(MESH_AXES) + ["zero", "params", "activations", "paths", "unnamed"]
            raise ShardkitError(f"rules.{key}", f"unknown key; valid keys are {valid}")
    for key in ("params", "activations"):
        for name, axes in kwargs.get(key, ()):
            for axis in axes:
                if axis not in MESH_AXES:
                    raise ShardkitError(f"rules.{key}.{name}", f"unknown mesh axis {axis!r}; valid axes are "
                                                               f"{list(MESH_AXES)}")
    return RulesSection(**kwargs)


def _path_rules(table: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`[rules.paths]`: regular expression -> a list of logical names, one per dimension ("" for none), kept in file
    order (the first full match wins)."""
    if not isinstance(table, dict):
        raise ShardkitError("rules.paths", "must be a table of path regular expression -> list of logical names, e.g. "
                                           "'.*/query/kernel' = [\"embed\", \"heads\", \"\"]")
    rules = []
    for pattern, names in table.items():
        field = f"rules.paths.{pattern!r}"
        try:
            re.compile(pattern)
        except re.error as err:
            raise ShardkitError(field, f"is not a regular expression: {err}") from None
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise ShardkitError(field, f"must be a list of logical names, one per dimension (\"\" for a dimension "
                                       f"left unnamed), got {names!r}")
        rules.append((pattern, tuple(names)))
    return tuple(rules)


def _names(field: str, value: Any) -> tuple[str, ...]:
    """A name, a list of names, or an empty list / "none" for nothing."""
    if value in ("none", "", None):
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ShardkitError(field, f"must be a name or a list of names, got {value!r}")


def _check_type(field: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return _check_type(field, value, options[0])
    if origin is tuple:
        return _names(field, value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ShardkitError(field, f"must be a finite number, got {value}")
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ShardkitError(field, f"must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def _freeze(tables: Mapping[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType({key: dict(value) if isinstance(value, dict) else value
                                   for key, value in tables.items()})


def resolved_tables(recipe: Recipe, model_dims: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The recipe with every default filled in, as TOML-ready tables that load back as the same `Recipe`.

    This is what a run directory's `recipe.toml` holds (the recipe file, its `--set` overrides and the defaults of
    every key it left out), so `shardkit train RUN/recipe.toml` reruns the run whatever the defaults become.

    Args:
        recipe: the validated recipe.
        model_dims: the model's resolved configuration (`registry.model_config`), written into `[model]` beside the
            preset so the file shows the sizes the preset stands for. Fields that are not TOML scalars are left to
            the preset.
    """
    tables = {section: _plain_table(getattr(recipe, section)) for section in SECTIONS
              if section not in ("model", "rules")}
    tables["model"] = _model_table(recipe.model, model_dims or {})
    tables["rules"] = _rules_table(recipe.rules)
    return {section: tables[section] for section in SECTIONS}


def _model_table(section: ModelSection, model_dims: Mapping[str, Any]) -> dict[str, Any]:
    scalars = {key: value for key, value in model_dims.items() if isinstance(value, (bool, int, float, str))}
    return {"name": section.name, "preset": section.preset, **scalars, **dict(section.dims)}


def _rules_table(rules: RulesSection) -> dict[str, Any]:
    """Shorthands left out (None) stay out: writing `[]` would mean "this axis shards nothing", another recipe."""
    table: dict[str, Any] = {axis: list(getattr(rules, axis)) for axis in MESH_AXES if getattr(rules, axis) is not None}
    table["zero"] = rules.zero
    table["unnamed"] = rules.unnamed
    for key in ("params", "activations", "paths"):
        if getattr(rules, key):
            table[key] = {name: list(axes) for name, axes in getattr(rules, key)}
    return table


def _plain_table(section: Any) -> dict[str, Any]:
    """A section's fields as TOML values; a field left None (an optional setting not given) is left out, as TOML has
    no null and reading the table back gives None again."""
    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(section).items() if value is not None}


def to_toml(tables: Mapping[str, Any], comments: tuple[str, ...] | list[str] = (), field: str = "recipe") -> str:
    """Recipe tables as TOML text, after `comments` (one `# ` line each): shardkit's one TOML writer (tomli-w), so
    any key (dotted, quoted, non-ASCII) and any string (characters outside the BMP, control characters) reads back.

    Raises:
        ShardkitError: a value TOML cannot hold (None, an object), naming `field`.
    """
    try:
        body = tomli_w.dumps(_plain(tables))
    except TypeError as err:
        raise ShardkitError(field, f"cannot be written as TOML: {err}") from None
    return "".join(f"# {_comment_text(line)}\n" for line in comments) + body


def _comment_text(line: str) -> str:
    """`line` as a TOML comment may hold it: control characters (a newline in a `--set` value shown in the header,
    which would end the comment and leave the rest as broken TOML) written as Python escapes, e.g. `\\n`."""
    return re.sub(r"[\x00-\x08\x0a-\x1f\x7f]", lambda match: match.group().encode("unicode_escape").decode(), line)


def resolved_toml(recipe: Recipe, model_dims: Mapping[str, Any], comments: tuple[str, ...] | list[str] = ()) -> str:
    """`resolved_tables` as TOML, `[model]` holding the model's whole configuration (`registry.model_dims`)."""
    return to_toml(resolved_tables(recipe, model_dims), comments)


def toml_value(value: Any) -> str:
    """One value as TOML writes it (e.g. for a `--set key=VALUE` hint)."""
    return to_toml({"v": value}).removeprefix("v = ").rstrip("\n")


def _plain(value: Any) -> Any:
    """Read-only mappings (a recipe's `raw`) as dicts all the way down, which is what tomli-w writes."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value
