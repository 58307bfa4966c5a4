"""`shardkit data prepare`: text and JSONL files -> the flat token files the `bin` data source reads.

    shardkit data prepare --tokenizer tokenizer.json corpus/*.jsonl notes.txt --out data/mine

writes

    DIR/train.bin        token ids, uint16 (vocab <= 65536) or uint32, documents back to back, EOS after each
    DIR/val.bin          the held-out split (the last documents, about --val-fraction of the tokens)
    DIR/meta.json        {"tokenizer", "vocab_size", "eos_id", "dtype", "splits": {name: {"path", "tokens"}},
                          "documents", "inputs"}
    DIR/tokenizer.json   a copy of the tokenizer (what `shardkit generate` decodes with)

Documents: each line of a `.jsonl` file is one (its `--text-key` field, default "text"); any other file is one document,
read and encoded in chunks of whole lines, so a file of any size streams through a bounded amount of memory.
Training then uses `[data] source = "bin"`, `path = "DIR/train.bin"`; the held-out split is found from the meta.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from shardkit.errors import ShardkitError

META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|eot_id|>")
CHUNK_BYTES = 1 << 20  # text read and encoded this many bytes (whole lines) at a time
BATCH_DOCUMENTS = 256  # JSONL documents encoded per encode_batch call


def prepare(inputs: Sequence[str | Path], tokenizer_path: str | Path, out_dir: str | Path,
            val_fraction: float = 0.01, eos: str | None = None, text_key: str = "text", log=None) -> dict:
    """Tokenize `inputs` into `out_dir` (see the module docstring); returns the metadata written.

    Raises:
        ShardkitError: a missing input or tokenizer, an unknown EOS token, a bad fraction, a non-empty `out_dir`.
    """
    from tokenizers import Tokenizer

    log = sys.stderr if log is None else log
    paths = _check_inputs(inputs, out_dir, val_fraction)
    tokenizer_path = Path(tokenizer_path)
    if not tokenizer_path.is_file():
        raise ShardkitError("--tokenizer", f"no tokenizer file at {str(tokenizer_path)!r} (a tokenizers JSON file)")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as err:  # the Rust library raises plain Exceptions for malformed files
        raise ShardkitError("--tokenizer", f"{tokenizer_path} is not a tokenizers JSON file: {err}") from None
    eos_id = _eos_id(tokenizer, eos)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    final_dir = Path(out_dir)
    out_dir = final_dir.with_name(final_dir.name + ".partial")  # renamed into place once complete
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    try:
        ends = _write_tokens(paths, tokenizer, eos_id, dtype, out_dir / "train.bin", text_key, log)
        cut = _split_point(ends, val_fraction)
    except ShardkitError:
        shutil.rmtree(out_dir)
        raise
    _split_off(out_dir / "train.bin", out_dir / "val.bin", cut, dtype)
    shutil.copyfile(tokenizer_path, out_dir / TOKENIZER_FILE)
    total = int(ends[-1]) if len(ends) else 0
    meta = {
        "tokenizer": TOKENIZER_FILE, "vocab_size": vocab, "eos_id": eos_id, "dtype": dtype.name,
        "splits": {"train": {"path": "train.bin", "tokens": cut}, "val": {"path": "val.bin", "tokens": total - cut}},
        "documents": len(ends), "inputs": [str(path) for path in paths],
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    if final_dir.exists():
        final_dir.rmdir()  # empty, checked above
    out_dir.rename(final_dir)
    return meta


def _check_inputs(inputs, out_dir, val_fraction: float) -> list[Path]:
    if not 0.0 < val_fraction < 1.0:
        raise ShardkitError("--val-fraction", f"must be in (0, 1), got {val_fraction}")
    paths = [Path(item) for item in inputs]
    if not paths:
        raise ShardkitError("INPUT", "give at least one text or JSONL file")
    for path in paths:
        if not path.is_file():
            raise ShardkitError("INPUT", f"no file at {str(path)!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ShardkitError("--out", f"{out_dir} exists and is not empty; give a new directory")
    return paths


def _eos_id(tokenizer, eos: str | None) -> int:
    candidates = (eos,) if eos is not None else EOS_CANDIDATES
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    if eos is not None:
        raise ShardkitError("--eos", f"{eos!r} is not a token of the tokenizer")
    raise ShardkitError("--eos", f"the tokenizer has none of {list(EOS_CANDIDATES)}; name its end-of-document token")


def _write_tokens(paths, tokenizer, eos_id: int, dtype, target: Path, text_key: str, log) -> np.ndarray:
    """Encode every document into `target`, EOS after each; returns each document's end offset (in tokens)."""
    progress = _ByteProgress(sum(path.stat().st_size for path in paths), log)
    ends, total = [], 0
    with open(target, "wb") as out:
        for path in paths:
            for ids, nbytes, document_ends in _documents(path, tokenizer, text_key):
                out.write(np.asarray(ids, dtype=np.int64).astype(dtype).tobytes())
                total += len(ids)
                if document_ends:
                    out.write(np.asarray([eos_id], dtype).tobytes())
                    total += 1
                    ends.append(total)
                progress.advance(nbytes)
    progress.finish(total, len(ends))
    return np.asarray(ends, dtype=np.int64)


def _documents(path: Path, tokenizer, text_key: str) -> Iterator[tuple[list[int], int, bool]]:
    """(token ids, bytes of input they came from, whether a document ends there) pieces of the documents in `path`."""
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path, tokenizer, text_key)
        return
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            chunk += handle.readline()  # whole lines, so no word (or UTF-8 sequence) is cut in two
            yield tokenizer.encode(chunk.decode("utf-8", errors="replace"), add_special_tokens=False).ids, len(chunk), False
    yield [], 0, True


def _jsonl_documents(path: Path, tokenizer, text_key: str) -> Iterator[tuple[list[int], int, bool]]:
    texts, sizes = [], []
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                texts.append(_jsonl_text(line, text_key, path, number))
                sizes.append(len(line))
            if len(texts) == BATCH_DOCUMENTS:
                yield from _encoded(tokenizer, texts, sizes)
                texts, sizes = [], []
    yield from _encoded(tokenizer, texts, sizes)


def _encoded(tokenizer, texts, sizes):
    for encoding, size in zip(tokenizer.encode_batch(texts, add_special_tokens=False), sizes):
        yield encoding.ids, size, True


def _jsonl_text(line: bytes, key: str, path: Path, number: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise ShardkitError("INPUT", f"{path}:{number} is not a JSON object") from None
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise ShardkitError("--text-key", f"{path}:{number} has no string field {key!r}")
    return record[key]


def _split_point(ends: np.ndarray, val_fraction: float) -> int:
    """Where the held-out split starts: the document boundary nearest below (1 - fraction) of the tokens, or, when
    documents are too long for that (a single big file), that token position itself."""
    if len(ends) == 0 or ends[-1] < 4:
        raise ShardkitError("INPUT", "the inputs hold (almost) no text; nothing to split")
    total = int(ends[-1])
    target = int(total * (1 - val_fraction))
    boundaries = ends[ends <= target]
    boundary = int(boundaries[-1]) if len(boundaries) else 0
    return boundary if boundary >= total * (1 - 2 * val_fraction) else target


def _split_off(train: Path, val: Path, cut: int, dtype: np.dtype) -> None:
    """Move the tokens from `cut` on into `val`, truncating `train` there (no copy of the training part)."""
    with open(train, "rb") as source, open(val, "wb") as out:
        source.seek(cut * dtype.itemsize)
        shutil.copyfileobj(source, out)
    os.truncate(train, cut * dtype.itemsize)


class _ByteProgress:
    """`prepare: 42% of 1.2 GB, 310,000,000 tokens` on one line of stderr, refreshed at most every half second."""

    def __init__(self, total_bytes: int, log):
        self.total, self.done, self.log, self.shown = max(total_bytes, 1), 0, log, 0.0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if now - self.shown > 0.5:
            self.shown = now
            self.log.write(f"\rprepare: {100 * self.done / self.total:3.0f}% of {self.total / 1e6:,.1f} MB")
            self.log.flush()

    def finish(self, tokens: int, documents: int) -> None:
        self.log.write(f"\rprepare: 100% of {self.total / 1e6:,.1f} MB: {tokens:,} tokens in {documents:,} documents\n")


def read_meta(bin_path: str | Path) -> dict | None:
    """The meta.json `data prepare` wrote beside a .bin file, or None when there is none."""
    path = Path(bin_path).parent / META_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ShardkitError("data.path", f"{path} is not valid JSON") from None
