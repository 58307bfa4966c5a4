"""Greedy generation with and without the KV cache: the same tokens, and tokens/s for each.

    python bench/generate.py [--recipe recipes/fsdp.toml] [--preset tiny] [--prompt 16] [--tokens 200] [--repeats 3]

Both paths run under the recipe's layout on one CPU device (`shardkit.run.generate.Generator`, greedy, no
end-of-document token) from the same randomly initialised parameters and prompt. One unmeasured run of each comes
first (it compiles); then the median wall time of `--repeats` runs gives tokens/s. Prints one JSON line per path and
whether the two token lists are identical (the script exits 1 if they are not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def setup(recipe_path: str, preset: str, prompt_length: int, seed: int = 0):
    """(layout, parameters, prompt ids) for a one-device layout of the recipe with a fresh model."""
    import jax
    import numpy as np

    from shardkit.layout import build_layout, init_params
    from shardkit.recipe import load_recipe

    recipe = load_recipe(recipe_path, [f"model.preset={preset}"])
    layout = build_layout(recipe, jax.devices()[:1])
    params = init_params(layout, seed)
    prompt = np.random.default_rng(seed).integers(0, layout.config.vocab, prompt_length).tolist()
    return layout, params, prompt


def timed(layout, params, prompt, tokens: int, kv_cache: bool, repeats: int) -> tuple[list[int], float]:
    """(generated ids, median seconds) of greedy generation, after one unmeasured (compiling) run."""
    from shardkit.run.generate import Generator, Sampling

    generator = Generator(layout, Sampling(max_tokens=tokens, kv_cache=kv_cache))
    ids = generator(params, [prompt], None)[0]
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        generator(params, [prompt], None)
        seconds.append(time.perf_counter() - began)
    return ids, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/fsdp.toml")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    layout, params, prompt = setup(args.recipe, args.preset, args.prompt)
    results = {}
    for kv_cache in (True, False):
        ids, seconds = timed(layout, params, prompt, args.tokens, kv_cache, args.repeats)
        results[kv_cache] = ids
        print(json.dumps({"kv_cache": kv_cache, "preset": args.preset, "prompt": args.prompt, "tokens": len(ids),
                          "seconds": round(seconds, 4), "tokens_per_s": round(len(ids) / seconds, 1)}))
    same = results[True] == results[False]
    print(json.dumps({"identical": same, "tokens": len(results[True])}))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
