"""Greedy generation: shardkit's compiled loop, its host-loop check, and transformers' static cache; tokens/s each.

    python bench/generate.py [--recipe recipes/fsdp.toml] [--preset tiny] [--prompt 16] [--tokens 200] [--repeats 3]
    python bench/generate.py --preset 1b --policy bf16 --prompt 16 --tokens 128 --hf   # the GPU row
    python bench/generate.py --json FILE   # also write the rows as JSON

All paths run from the same randomly initialised parameters and prompt (one row), greedy, with no end-of-document
token, so each generates exactly `--tokens` tokens. shardkit's paths run under the recipe's layout on one device
(`shardkit.run.generate.Generator`, parameters placed on the device once, outside the timing): `kv_cache` the whole
generation as one compiled program (prefill, then a `while_loop` over the KV cache), `host_loop` every token recomputed
over the whole buffer with a dispatch and a read per token (`--no-kv-cache`'s check path; `--skip-host-loop` leaves it
out). `--hf` adds transformers' `LlamaForCausalLM` holding the same weights (`shardkit.hf.convert.hf_tensors`), in the
policy's dtype on the GPU when there is one, generating with its static cache (`cache_implementation="static"`): only
where torch and transformers import, else its row says so. One unmeasured run of each comes first (it compiles);
then the median wall time of `--repeats` runs gives tokens/s. Prints one JSON line per path and whether shardkit's
paths and transformers' picked identical tokens (the script exits 1 if shardkit's two do not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def setup(recipe_path: str, preset: str, prompt_length: int, seed: int = 0, policy: str | None = None):
    """(layout, parameters, prompt ids) for a one-device layout of the recipe with a fresh model."""
    import jax
    import numpy as np

    from shardkit.layout import build_layout, init_params
    from shardkit.recipe import load_recipe

    overrides = [f"model.preset={preset}"] + ([f"precision.policy={policy}"] if policy else [])
    layout = build_layout(load_recipe(recipe_path, overrides), jax.devices()[:1])
    params = init_params(layout, seed)
    prompt = np.random.default_rng(seed).integers(0, layout.config.vocab, prompt_length).tolist()
    return layout, params, prompt


def timed(layout, params, prompt, tokens: int, kv_cache: bool, repeats: int) -> tuple[list[int], float]:
    """(generated ids, median seconds) of greedy generation, after one unmeasured (compiling) run."""
    import jax

    from shardkit.run.generate import Generator, Sampling

    generator = Generator(layout, Sampling(max_tokens=tokens, kv_cache=kv_cache))
    placed = jax.block_until_ready(generator.place(params))
    ids = generator.run(placed, [prompt], None)[0]
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        generator.run(placed, [prompt], None)
        seconds.append(time.perf_counter() - began)
    return ids, statistics.median(seconds)


def hf_available() -> str | None:
    """None when torch and transformers import, else why not."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        return f"transformers not measured: {err}"
    return None


def hf_timed(layout, params, prompt, tokens: int, repeats: int) -> tuple[list[int], float, str]:
    """(generated ids, median seconds, device) of transformers' greedy generation with its static cache, from the same
    weights, after one unmeasured run (its first call sets the cache up and warms the kernels)."""
    import jax
    import numpy as np
    import torch
    import transformers

    from shardkit.hf.config import hf_config
    from shardkit.hf.convert import hf_tensors

    device = "cuda" if torch.cuda.is_available() else "cpu"
    half = np.dtype(layout.policy.compute_dtype).itemsize == 2
    dtype = torch.bfloat16 if device == "cuda" and half else torch.float32
    config = transformers.LlamaConfig(**hf_config(layout.config))
    model = transformers.LlamaForCausalLM(config)
    host = jax.tree.map(np.asarray, params)
    model.load_state_dict({name: torch.from_numpy(array) for name, array in hf_tensors(host, layout.config).items()},
                          strict=False)  # a tied head is the embedding itself
    model = model.to(device=device, dtype=dtype).eval()
    input_ids = torch.tensor([prompt], device=device)
    options = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False,
               "cache_implementation": "static", "pad_token_id": 0}

    def generate():
        with torch.no_grad():
            out = model.generate(input_ids, **options)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    ids = generate()[0, len(prompt):].tolist()
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        generate()
        seconds.append(time.perf_counter() - began)
    return ids, statistics.median(seconds), torch.cuda.get_device_name() if device == "cuda" else "cpu"


def rows(args) -> list[dict]:
    """One row per path (printed as it comes), then the comparison row."""
    import jax
    import numpy as np

    layout, params, prompt = setup(args.recipe, args.preset, args.prompt, policy=args.policy)
    common = {"preset": args.preset, "compute": np.dtype(layout.policy.compute_dtype).name, "prompt": args.prompt,
              "device": jax.devices()[0].device_kind}
    out, ids = [], {}
    paths = [("kv_cache", True)] + ([] if args.skip_host_loop else [("host_loop", False)])
    for path, kv_cache in paths:
        ids[path], seconds = timed(layout, params, prompt, args.tokens, kv_cache, args.repeats)
        out.append(_row(common, path, ids[path], seconds))
    if args.hf:
        missing = hf_available()
        if missing:
            out.append({**common, "path": "transformers_static_cache", "error": missing})
        else:
            ids["hf"], seconds, device = hf_timed(layout, params, prompt, args.tokens, args.repeats)
            out.append({**_row(common, "transformers_static_cache", ids["hf"], seconds), "device": device})
    same = len({tuple(value) for key, value in ids.items() if key != "hf"}) == 1
    out.append({"identical": same, "tokens": len(ids["kv_cache"]),
                "hf_identical": ids["hf"] == ids["kv_cache"] if "hf" in ids else None})
    if "hf" in ids and out[-2].get("tokens_per_s"):
        out[-1]["shardkit_over_hf"] = round(out[0]["tokens_per_s"] / out[-2]["tokens_per_s"], 2)
    return out


def _row(common: dict, path: str, ids: list[int], seconds: float) -> dict:
    return {**common, "path": path, "tokens": len(ids), "seconds": round(seconds, 4),
            "tokens_per_s": round(len(ids) / seconds, 1)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/fsdp.toml")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--policy", help="precision.policy (default: the recipe's)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf", action="store_true", help="also transformers with its static cache (needs torch)")
    parser.add_argument("--skip-host-loop", action="store_true", help="leave out the recomputing host loop")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = rows(args)
    for row in out:
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if out[-1]["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
