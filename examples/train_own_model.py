"""Your own Flax NNX model, annotated the Flax way, trained by shardkit's layout in your own loop (fsdp_tp: FSDP over
2 x tensor parallelism over 4). `python examples/train_own_model.py` runs it on 8 fake CPU devices."""
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


class MyModel(nnx.Module):
    Config = Config
    PRESETS = {"tiny": Config()}  # recipes ask for the `tiny` preset

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        shard, init = nnx.with_partitioning, nnx.initializers
        self.embed = nnx.Embed(cfg.vocab, cfg.embed, embedding_init=shard(init.normal(0.1), ("vocab", "embed")),
                               rngs=rngs)
        self.up = nnx.Linear(cfg.embed, cfg.mlp, kernel_init=shard(init.lecun_normal(), ("embed", "mlp")),
                             use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp, cfg.embed, kernel_init=shard(init.lecun_normal(), ("mlp", "embed")),
                               use_bias=False, rngs=rngs)

    def __call__(self, tokens_BS):
        x_BSD = self.embed(tokens_BS)
        return self.embed.attend(x_BSD + self.down(jax.nn.gelu(self.up(x_BSD))))


def loss_fn(model, tokens_BS1):
    logits_BSV = model(tokens_BS1[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, tokens_BS1[:, 1:]).mean(), {}


def main(steps: int = 30) -> list[float]:
    recipe = shardkit.load("fsdp_tp", model=MyModel)
    trainer = shardkit.Trainer.build(recipe, loss_fn, optax.adamw(1e-2))
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
