"""A Flax NNX model that names nothing (plain `nnx.Embed`, `nnx.Linear`, `nnx.LayerNorm`, as most code is written),
laid out by the recipe alone: `[rules.paths]` gives its weights logical names by path, its norms stay unnamed and
replicated, and it trains under fsdp_tp (FSDP over 2 x tensor parallelism over 4).
`python examples/train_unnamed_model.py` runs it on 8 fake CPU devices; `shardkit plan fsdp_tp --devices 8 --set
model.name=train_unnamed_model:UnnamedModel --set 'rules.paths={...}'` shows where each parameter's names come from.
"""
import dataclasses

import jax
import numpy as np
import optax
from flax import nnx

import shardkit


@dataclasses.dataclass(frozen=True)
class Config:
    embed: int = 64
    mlp: int = 256
    vocab: int = 256
    layers: int = 2


class Block(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(cfg.embed, rngs=rngs)
        self.up = nnx.Linear(cfg.embed, cfg.mlp, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp, cfg.embed, use_bias=False, rngs=rngs)

    def __call__(self, x_BSD):
        return x_BSD + self.down(jax.nn.gelu(self.up(self.norm(x_BSD))))


class UnnamedModel(nnx.Module):
    Config = Config
    PRESETS = {"tiny": Config()}  # recipes ask for the `tiny` preset

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.embed, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.head = nnx.Linear(cfg.embed, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens_BS):
        x_BSD = self.embed(tokens_BS)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.head(x_BSD)


# Regular expressions matched in full against the paths `shardkit plan` prints -> one logical name per dimension.
PATHS = {
    r"embed/embedding": ["vocab", "embed"],
    r"blocks/\d+/up/kernel": ["embed", "mlp"],
    r"blocks/\d+/down/kernel": ["mlp", "embed"],
    r"head/kernel": ["embed", "vocab"],
}


def recipe() -> shardkit.Recipe:
    paths = ", ".join(f"'{pattern}' = {names}" for pattern, names in PATHS.items())
    return shardkit.load("fsdp_tp", f"rules.paths={{ {paths} }}", model=UnnamedModel)


def loss_fn(model, tokens_BS1):
    logits_BSV = model(tokens_BS1[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, tokens_BS1[:, 1:]).mean(), {}


def main(steps: int = 30) -> list[float]:
    trainer = shardkit.Trainer.build(recipe(), loss_fn, optax.adamw(1e-2))
    state, rng, losses = trainer.init(), np.random.default_rng(0), []
    for step in range(steps):
        start = rng.integers(0, 256, (16, 1))
        tokens = (start + 7 * np.arange(65)) % 256  # each next token follows from the one before
        state, metrics = trainer.step(state, trainer.shard(tokens.astype(np.int32)))
        losses.append(float(metrics["loss"]))
        print(f"step {step}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # fake devices; on 8 real accelerators drop this line
    main()
