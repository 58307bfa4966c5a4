"""`shardkit data prepare` with a tiny BPE trained here (nothing downloaded): every input format gives the same tokens
as its plain original, other files are refused in one line, the vocab check, a run on the prepared tokens whose
held-out loss falls, and `shardkit generate` from that run."""

from __future__ import annotations

import gzip
import io
import json
import sys

import jax
import numpy as np
import pytest

from shardkit.cli import main
from shardkit.data import documents
from shardkit.data.prepare import prepare
from shardkit.errors import ShardkitError
from shardkit.run.loop import train
from tests.helpers import recipe

WORDS = ("the cat dog bird fish sees eats likes chases big small red green quick slow and a one two three runs "
         "sleeps over under near far house tree river stone").split()
VOCAB = 320  # the BPE below: 256 bytes, </s>, and merges up to this size


def sentence(rng: np.random.Generator) -> str:
    """A tiny grammar, so that a small model can learn something in a few steps."""
    subject, verb, obj = rng.choice(WORDS[:5]), rng.choice(WORDS[5:9]), rng.choice(WORDS[:5])
    return f"the {rng.choice(WORDS[9:15])} {subject} {verb} the {obj}."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~400 KB of text: a JSONL file of 1500 documents and one plain text file, plus a BPE tokenizer trained on them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    docs = [" ".join(sentence(rng) for _ in range(rng.integers(3, 12))) for _ in range(1500)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    (root / "book.txt").write_text("\n".join(sentence(rng) for _ in range(1500)) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([str(root / "docs.jsonl"), str(root / "book.txt")], trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    return root, docs, tokenizer


@pytest.fixture(scope="module")
def prepared(corpus):
    root, _, _ = corpus
    out = root / "prepared"
    log = io.StringIO()
    meta = prepare([root / "docs.jsonl", root / "book.txt"], root / "tokenizer.json", out, 0.05, log=log)
    assert "100%" in log.getvalue()
    return out, meta


def tokens(out) -> np.ndarray:
    """All prepared tokens, the held-out split after the training one."""
    return np.concatenate([np.fromfile(out / "train.bin", np.uint16), np.fromfile(out / "val.bin", np.uint16)])


def compressed(path, suffix: str):
    """A copy of `path` compressed as `suffix` (.gz or .zst) beside it."""
    import zstandard

    data = path.read_bytes()
    target = path.with_name(path.name + suffix)
    target.write_bytes(gzip.compress(data) if suffix == ".gz" else zstandard.ZstdCompressor().compress(data))
    return target


def parquet_copy(jsonl, target, row_group_size=400):
    """The JSONL documents as a parquet file's `body` column beside an `id` column, in several row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]
    table = pa.table({"id": list(range(len(texts))), "body": texts})
    pq.write_table(table, target, row_group_size=row_group_size)
    return target


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_compressed_inputs_prepare_to_the_same_tokens(corpus, prepared, tmp_path, suffix):
    root, _, _ = corpus
    inputs = [compressed(root / "docs.jsonl", suffix), compressed(root / "book.txt", suffix)]
    meta = prepare(inputs, root / "tokenizer.json", tmp_path / "out", 0.05, log=io.StringIO())
    np.testing.assert_array_equal(tokens(tmp_path / "out"), tokens(prepared[0]))
    assert meta["splits"] == prepared[1]["splits"] and meta["documents"] == prepared[1]["documents"]


def test_parquet_column_prepares_like_the_jsonl(corpus, tmp_path):
    root, docs, _ = corpus
    table = parquet_copy(root / "docs.jsonl", tmp_path / "docs.parquet")
    from_jsonl = prepare([root / "docs.jsonl"], root / "tokenizer.json", tmp_path / "a", 0.05, log=io.StringIO())
    from_parquet = prepare([table], root / "tokenizer.json", tmp_path / "b", 0.05, text_key="body", log=io.StringIO())
    np.testing.assert_array_equal(tokens(tmp_path / "b"), tokens(tmp_path / "a"))
    assert from_parquet["documents"] == from_jsonl["documents"] == len(docs)


def test_a_text_file_in_many_pieces_encodes_like_the_whole(corpus, tmp_path, monkeypatch):
    """Pieces of whole lines, cut only before a visible character, in one batch and over several batches: the tokens
    are exactly those of the whole file in one `encode` (blank lines and indented lines included)."""
    root, _, tokenizer = corpus
    rng = np.random.default_rng(1)
    lines = [rng.choice(["", "  ", "\t", "   indented " + sentence(rng)]) if rng.random() < 0.3 else sentence(rng)
             for _ in range(600)]
    text = "\n".join(lines) + "\n\n"
    (tmp_path / "spaced.txt").write_text(text)
    monkeypatch.setattr(documents, "PIECE_BYTES", 1000)
    monkeypatch.setattr(documents, "BATCH_BYTES", 8000)
    prepare([tmp_path / "spaced.txt"], root / "tokenizer.json", tmp_path / "out", 0.05, log=io.StringIO())
    ids = tokens(tmp_path / "out")
    assert ids[:-1].tolist() == tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids[:-1].tolist()) == text


def test_progress_shows_documents_and_tokens_per_second(corpus, tmp_path):
    root, docs, _ = corpus
    log = io.StringIO()
    meta = prepare([root / "docs.jsonl"], root / "tokenizer.json", tmp_path / "out", 0.05, log=log)
    last = log.getvalue().split("\r")[-1]
    total = sum(split["tokens"] for split in meta["splits"].values())
    assert last.startswith("prepare: 100% of ") and last.endswith("\n")
    assert f"| {len(docs):,} documents (" in last and f"| {total:,} tokens (" in last and last.count("/s)") == 2


def test_progress_of_a_compressed_input_counts_its_compressed_bytes(corpus, tmp_path):
    """The position is the compressed bytes read, so the total is the file's compressed size, not `0.0 MB`."""
    root, _, _ = corpus
    packed = tmp_path / "docs.jsonl.gz"
    packed.write_bytes(gzip.compress((root / "docs.jsonl").read_bytes(), mtime=0))
    size = packed.stat().st_size
    assert 1e3 <= size < 1e6
    log = io.StringIO()
    prepare([packed], root / "tokenizer.json", tmp_path / "out", 0.05, log=log)
    assert log.getvalue().split("\r")[-1].startswith(f"prepare: 100% of {size / 1e3:.1f} kB on disk | ")


@pytest.mark.parametrize("name, content, message", [
    ("notes.csv", b"a,b\n", "cannot read 'notes.csv'; give .txt, .jsonl or .parquet"),
    ("notes", b"text\n", "cannot read 'notes'; give .txt, .jsonl or .parquet"),
    ("model.bin", b"\x00\x01", "cannot read 'model.bin'"),
    ("corpus.parquet.gz", gzip.compress(b"PAR1", mtime=0), "cannot read 'corpus.parquet.gz'"),
    ("corpus.jsonl", gzip.compress(b'{"text": "a"}\n', mtime=0), "corpus.jsonl is gz data; name a file by its format"),
    ("corpus.jsonl.gz", b'{"text": "a"}\n', "corpus.jsonl.gz is not gz; name a file by its format"),
    ("corpus.txt.zst", gzip.compress(b"a\n", mtime=0), "corpus.txt.zst is gz data; name a file by its format"),
    ("corpus.parquet", b'{"text": "a"}\n', "corpus.parquet is not parquet"),
])
def test_other_files_are_refused_in_one_line(corpus, tmp_path, capsys, name, content, message):
    root, _, _ = corpus
    (tmp_path / name).write_bytes(content)
    args = ["data", "prepare", str(root / "book.txt"), str(tmp_path / name), "--tokenizer",
            str(root / "tokenizer.json"), "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardkit: error: INPUT: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_parquet_file_without_the_text_column_is_refused(corpus, tmp_path, capsys):
    root, _, _ = corpus
    table = parquet_copy(root / "docs.jsonl", tmp_path / "docs.parquet")
    args = ["data", "prepare", str(table), "--tokenizer", str(root / "tokenizer.json"), "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardkit: error: --text-key: ")
    assert "has no column 'text'; its columns: ['id', 'body']" in err
    assert main(args + ["--text-key", "id"]) == 2
    assert "column 'id' of" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_prepare_writes_documents_with_eos_and_a_held_out_split(corpus, prepared):
    _, docs, tokenizer = corpus
    out, meta = prepared
    assert meta["documents"] == len(docs) + 1 and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == tokenizer.get_vocab_size() <= VOCAB
    train_ids = np.fromfile(out / "train.bin", np.uint16)
    val_ids = np.fromfile(out / "val.bin", np.uint16)
    assert len(train_ids) == meta["splits"]["train"]["tokens"] and len(val_ids) == meta["splits"]["val"]["tokens"]
    assert 0.03 < len(val_ids) / (len(train_ids) + len(val_ids)) < 0.1
    eos = meta["eos_id"]
    assert eos == tokenizer.token_to_id("</s>")
    assert np.count_nonzero(train_ids == eos) + np.count_nonzero(val_ids == eos) == meta["documents"]
    first_end = int(np.argmax(train_ids == eos))
    assert tokenizer.decode(train_ids[:first_end].tolist()) == docs[0]
    assert val_ids[-1] == eos and (out / "tokenizer.json").is_file()


def test_training_refuses_a_larger_tokenizer_vocab(prepared, tmp_path, capsys):
    out, _ = prepared
    args = ["train", "recipes/fsdp.toml", "--out", str(tmp_path / "run"), "--set", "data.source=bin",
            "--set", f"data.path={out}/train.bin"]
    assert main(args) == 2  # the tiny preset's vocab is 256
    err = capsys.readouterr().err
    assert err.startswith("shardkit: error: data.path: ") and "model.vocab=256" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, field", [
    (["--tokenizer", "missing.json"], "--tokenizer"),
    (["--eos", "<nope>"], "--eos"),
    (["--val-fraction", "1.5"], "--val-fraction"),
])
def test_prepare_refuses_bad_input(corpus, tmp_path, capsys, args, field):
    root, _, _ = corpus
    base = ["data", "prepare", str(root / "book.txt"), "--out", str(tmp_path / "out")]
    if "--tokenizer" not in args:
        base += ["--tokenizer", str(root / "tokenizer.json")]
    assert main(base + args) == 2
    assert capsys.readouterr().err.startswith(f"shardkit: error: {field}: ")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    """30 steps of the tiny model on the prepared tokens (one device), evaluated every 10 on the held-out split."""
    out, _ = prepared
    run = tmp_path_factory.mktemp("run")
    overrides = (f"model.vocab={VOCAB}", "data.source=bin", f"data.path={out}/train.bin", "train.steps=30",
                 "train.seq_len=32", "eval.every=10", "eval.batches=2")
    result = train(recipe("single", *overrides), run, log=io.StringIO(), devices=jax.devices()[:1])
    return run, result.records


@pytest.mark.slow
def test_held_out_loss_falls(trained):
    run, records = trained
    evals = [(record["step"], record["eval_loss"], record["eval_ppl"])
             for record in records if "eval_loss" in record]
    assert [step for step, _, _ in evals] == [10, 20, 30]
    losses = [loss for _, loss, _ in evals]
    assert losses[0] > losses[1] > losses[2] and losses[2] < np.log(VOCAB) - 1.5
    assert all(abs(ppl - np.exp(loss)) < 1e-3 * ppl for _, loss, ppl in evals)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["eval_loss"] for line in logged if "eval_loss" in line] == losses


@pytest.mark.slow
def test_generate_continues_a_prompt(trained, capsys):
    run, _ = trained
    assert main(["generate", str(run), "--prompt", "the big", "--max-tokens", "12"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("the big") and len(greedy.strip()) > len("the big")
    assert main(["generate", str(run), "--prompt", "the big", "--max-tokens", "12"]) == 0
    assert capsys.readouterr().out == greedy  # greedy is deterministic
    assert main(["generate", str(run), "--prompt", "the big", "--temperature", "1.0", "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("the big")


@pytest.mark.slow
def test_generate_runs_several_prompts_as_one_batch(trained, capsys, tmp_path):
    """Repeated --prompt and a --prompts-file: one completion per prompt, in order, each the one it gets alone."""
    run, _ = trained
    alone = []
    for prompt in ("the big", "a"):
        assert main(["generate", str(run), "--prompt", prompt, "--max-tokens", "12"]) == 0
        alone.append(capsys.readouterr().out)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\n\n")
    argv = ["generate", str(run), "--prompt", "the big", "--prompts-file", str(prompts), "--max-tokens", "12"]
    assert main(argv) == 0
    assert capsys.readouterr().out == "".join(alone)
    assert main(["generate", str(run), "--prompts-file", str(tmp_path / "missing.txt")]) == 2
    assert capsys.readouterr().err.startswith("shardkit: error: --prompts-file: cannot read")


def test_a_missing_optional_reader_is_named_in_one_line(corpus, tmp_path, monkeypatch):
    """Parquet and zstd need the `data` extra; without it the message says how to get it."""
    root, _, _ = corpus
    table = parquet_copy(root / "docs.jsonl", tmp_path / "docs.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an environment without pyarrow sees on import
    needs = r"INPUT: reading docs.parquet needs pyarrow: pip install 'shardkit\[data\]'"
    with pytest.raises(ShardkitError, match=needs):
        prepare([table], root / "tokenizer.json", tmp_path / "out", 0.05, text_key="body", log=io.StringIO())
