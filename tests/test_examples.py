"""The tutorials' examples do what their pages say.

- The own-model walkthrough (examples/tiny_gpt.py, docs/tutorials/own-model.md): its Flax annotations land where the
  page shows, it trains on the shipped text under fsdp_tp like one device (fp32, the suite's 1e-5), and the page's
  commands (train, generate) run.
- Training on your own text (examples/train_tokenizer.py, docs/tutorials/own-text.md): the script's tokenizer has the
  vocab it was asked for and `data prepare` reads it; training its tokens with the recipe's vocab of 256 is refused in
  one line naming the vocab to set, before anything compiles.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest

from shardkit.cli import main
from shardkit.layout import build_layout
from shardkit.testing import sharding_specs
from tests.equivalence import FP32_RTOL, assert_traces_close, trace
from tests.helpers import ROOT, recipe

MODEL = "model.name=examples.tiny_gpt:TinyGPT"
TEXT = ("data.source=text", f"data.path={ROOT / 'data' / 'alice.txt'}")


def test_the_walkthrough_model_is_sharded_as_the_page_shows():
    specs = sharding_specs(build_layout(recipe("fsdp_tp", MODEL)))
    assert specs["blocks/0/attention/query/kernel"] == ["fsdp", "tensor", None]
    assert specs["blocks/0/attention/out/kernel"] == ["tensor", None, "fsdp"]
    assert specs["blocks/1/mlp/down/kernel"] == ["tensor", "fsdp"]
    assert specs["embedding/embedding"] == ["tensor", "fsdp"]
    assert specs["final_norm/scale"] == ["fsdp"]


@pytest.mark.slow
def test_the_walkthrough_model_trains_on_the_shipped_text_like_one_device():
    reference = trace(recipe("single", MODEL, *TEXT), devices=jax.devices()[:1])
    assert_traces_close(trace(recipe("fsdp_tp", MODEL, *TEXT)), reference, rtol=FP32_RTOL)
    assert reference.losses[-1] < reference.losses[0]


@pytest.mark.slow
def test_the_walkthrough_commands_train_and_generate(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the page runs from the repository root: examples.tiny_gpt imports from there
    run = str(tmp_path / "tiny_gpt")
    text = [f"--set={setting}" for setting in TEXT]
    assert main(["train", "fsdp_tp", "--out", run, "--steps", "2", "--set", MODEL, *text]) == 0
    capsys.readouterr()
    assert main(["generate", run, "--prompt", "The ", "--max-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("The ") and len(printed.rstrip("\n")) > len("The "), printed


def test_the_tokenizer_example_feeds_data_prepare_and_the_vocab_rule_holds(tmp_path, capsys):
    tokenizer, text = tmp_path / "alice-bpe.json", str(ROOT / "data" / "alice.txt")
    made = subprocess.run([sys.executable, str(ROOT / "examples" / "train_tokenizer.py"), text, "--vocab", "300",
                           "--out", str(tokenizer)], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and "vocab 300" in made.stdout, made.stderr
    refusals = (([str(tmp_path / "missing.txt")], "texts: no such file"),
                ([text, "--vocab", "10"], "--vocab: must be at least 257"))
    for bad, fragment in refusals:
        refused = subprocess.run([sys.executable, str(ROOT / "examples" / "train_tokenizer.py"), *bad, "--out",
                                  str(tmp_path / "refused.json")], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and fragment in refused.stderr, refused
    assert not (tmp_path / "refused.json").exists()
    prepared = tmp_path / "alice-bpe"
    assert main(["data", "prepare", "--tokenizer", str(tokenizer), text, "--out", str(prepared),
                 "--val-fraction", "0.05"]) == 0
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["vocab_size"] == 300 and meta["eos_id"] == 0  # the script's </s>, the first special token
    capsys.readouterr()
    bin_data = [f"--set=data.path={prepared / 'train.bin'}", "--set=data.source=bin", "--set=data.dtype=uint16"]
    assert main(["train", "fsdp", "--out", str(tmp_path / "run"), *bin_data]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a vocab of 300, larger than model.vocab=256; use --set model.vocab=300" in err, err
    assert not (tmp_path / "run").exists()
