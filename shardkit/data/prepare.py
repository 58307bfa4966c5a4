"""`shardkit data prepare`: text, JSONL and parquet files -> the flat token files the `bin` data source reads.

    shardkit data prepare --tokenizer tokenizer.json corpus/*.jsonl.gz notes.txt train-*.parquet --out data/mine

writes

    DIR/train.bin        token ids, uint16 (vocab <= 65536) or uint32, documents back to back, EOS after each
    DIR/val.bin          the held-out split (the last documents, about --val-fraction of the tokens)
    DIR/meta.json        {"tokenizer", "vocab_size", "eos_id", "dtype", "splits": {name: {"path", "tokens"}},
                          "documents", "inputs"}
    DIR/tokenizer.json   a copy of the tokenizer (what `shardkit generate` decodes with)

Documents: each line of a `.jsonl` file and each row of a `.parquet` file is one (its `--text-key` field or column,
default "text"); a `.txt` file is one; `.gz` and `.zst` compression is read (shardkit.data.documents lists the formats).
Texts go to the tokenizer's batch encoding a few MB at a time, which spreads them over every core, and a progress
line on stderr shows documents and tokens per second.
Training then uses `[data] source = "bin"`, `path = "DIR/train.bin"`; the held-out split is found from the meta.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from shardkit.data.documents import Batch, InputFile, batches, input_file
from shardkit.errors import ShardkitError

META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|eot_id|>")
PROGRESS_SECONDS = 0.5  # the progress line is redrawn at most this often


def prepare(inputs: Sequence[str | Path], tokenizer_path: str | Path, out_dir: str | Path,
            val_fraction: float = 0.01, eos: str | None = None, text_key: str = "text", log=None) -> dict:
    """Tokenize `inputs` into `out_dir` (see the module docstring); returns the metadata written.

    Raises:
        ShardkitError: a missing input or tokenizer, an unknown EOS token, a bad fraction, a non-empty `out_dir`.
    """
    from tokenizers import Tokenizer

    log = sys.stderr if log is None else log
    sources = _check_inputs(inputs, out_dir, val_fraction, text_key)
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
        ends = _write_tokens(sources, tokenizer, eos_id, dtype, out_dir / "train.bin", text_key, log)
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
        "documents": len(ends), "inputs": [str(source.path) for source in sources],
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    if final_dir.exists():
        final_dir.rmdir()  # empty, checked above
    out_dir.rename(final_dir)
    return meta


def _check_inputs(inputs, out_dir, val_fraction: float, text_key: str) -> list[InputFile]:
    """Every input's format, checked before anything is written."""
    if not 0.0 < val_fraction < 1.0:
        raise ShardkitError("--val-fraction", f"must be in (0, 1), got {val_fraction}")
    if not inputs:
        raise ShardkitError("INPUT", "give at least one .txt, .jsonl or .parquet file")
    sources = [input_file(Path(item), text_key) for item in inputs]
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ShardkitError("--out", f"{out_dir} exists and is not empty; give a new directory")
    return sources


def _eos_id(tokenizer, eos: str | None) -> int:
    candidates = (eos,) if eos is not None else EOS_CANDIDATES
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    if eos is not None:
        raise ShardkitError("--eos", f"{eos!r} is not a token of the tokenizer")
    raise ShardkitError("--eos", f"the tokenizer has none of {list(EOS_CANDIDATES)}; name its end-of-document token")


def _write_tokens(sources, tokenizer, eos_id: int, dtype, target: Path, text_key: str, log) -> np.ndarray:
    """Encode every document into `target`, EOS after each; returns each document's end offset (in tokens)."""
    progress = _Progress(sum(source.size for source in sources), log, any(source.compression for source in sources))
    ends, total, documents = [], 0, 0
    with open(target, "wb") as out:
        for source in sources:
            for batch in batches(source, text_key):
                ids, batch_ends = _encode(tokenizer, batch, eos_id)
                out.write(ids.astype(dtype).tobytes())
                ends.append(total + batch_ends)
                total, documents = total + len(ids), documents + len(batch_ends)
                progress.update(batch.position, documents, total)
            progress.file_done(source.size)
    progress.finish(documents, total)
    return np.concatenate(ends) if ends else np.zeros(0, np.int64)


def _encode(tokenizer, batch: Batch, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch's token ids back to back with EOS after each document that ends in it, and where those end.
    `encode_batch` runs on every core (the tokenizers library's own thread pool)."""
    encodings = tokenizer.encode_batch(batch.texts, add_special_tokens=False)
    pieces = [encoding.ids + [eos_id] if ends else encoding.ids for encoding, ends in zip(encodings, batch.ends)]
    offsets = np.cumsum([len(piece) for piece in pieces], dtype=np.int64)
    ids = np.fromiter(itertools.chain.from_iterable(pieces), np.int64, count=int(offsets[-1]) if len(pieces) else 0)
    return ids, offsets[np.asarray(batch.ends, dtype=bool)]


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


class _Progress:
    """`prepare: 42% of 1,200.0 MB | 52,000 documents (3,100/s) | 31,000,000 tokens (1.9M/s)` on one line of stderr,
    redrawn at most every PROGRESS_SECONDS; the position is in bytes of the files on disk, so with gz/zst inputs the
    total is their compressed size (`of 31.5 kB on disk`), far below the text's."""

    def __init__(self, total_bytes: int, log, compressed: bool = False):
        self.total, self.files_done, self.log = max(total_bytes, 1), 0, log
        self.unit = " on disk" if compressed else ""
        self.start = self.shown = time.monotonic()

    def update(self, position: int, documents: int, tokens: int) -> None:
        now = time.monotonic()
        if now - self.shown >= PROGRESS_SECONDS:
            self.shown = now
            self._show(min(self.files_done + position, self.total), documents, tokens, "")

    def file_done(self, size: int) -> None:
        self.files_done += size

    def finish(self, documents: int, tokens: int) -> None:
        self._show(self.total, documents, tokens, "\n")

    def _show(self, done: int, documents: int, tokens: int, end: str) -> None:
        seconds = max(time.monotonic() - self.start, 1e-9)
        self.log.write(
            f"\rprepare: {100 * done / self.total:3.0f}% of {_size(self.total)}{self.unit} | {documents:,} documents "
            f"({documents / seconds:,.0f}/s) | {tokens:,} tokens ({_rate(tokens / seconds)}/s){end}"
        )
        self.log.flush()


def _size(count: int) -> str:
    """`812 B`, `31.5 kB`, `1,200.0 MB`: a small input (a compressed one often is) does not show as `0.0 MB`."""
    if count < 1000:
        return f"{count} B"
    return f"{count / 1e3:.1f} kB" if count < 1e6 else f"{count / 1e6:,.1f} MB"


def _rate(per_second: float) -> str:
    return f"{per_second / 1e6:.2f}M" if per_second >= 1e6 else f"{per_second:,.0f}"


def read_meta(bin_path: str | Path) -> dict | None:
    """The meta.json `data prepare` wrote beside a .bin file, or None when there is none."""
    path = Path(bin_path).parent / META_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ShardkitError("data.path", f"{path} is not valid JSON") from None
