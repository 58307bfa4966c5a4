"""The input files of `shardkit data prepare`, read as batches of texts for the tokenizer's batch encoding.

Formats, told by the file name and checked against the file's first bytes:

    .txt                  one document per file, read in pieces of whole lines
    .jsonl                one document per line, its `--text-key` field (default "text")
    .parquet              one document per row, its `--text-key` column (Hugging Face datasets' format)
    .txt.gz  .jsonl.gz    the same, gzip-compressed
    .txt.zst .jsonl.zst   the same, zstd-compressed

Any other file is refused before any work starts: a compressed file read as text would otherwise become one document of
garbage. Every reader streams, so a file of any size goes through a bounded amount of memory.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import BinaryIO, Iterator

from shardkit.errors import ShardkitError

MAGIC = {"gz": b"\x1f\x8b", "zst": b"\x28\xb5\x2f\xfd", "parquet": b"PAR1"}
KINDS = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
ACCEPTED = ".txt, .jsonl or .parquet (.txt and .jsonl may end in .gz or .zst)"
PIECE_BYTES = 1 << 16  # a .txt file is encoded in pieces of about this many bytes (whole lines), many at once
MAX_PIECE_BYTES = 4 * PIECE_BYTES  # ... extended to a clean cut (see _read_piece) up to this size
BATCH_BYTES = 1 << 22  # texts read before one encode_batch call: enough work for every core


@dataclasses.dataclass(frozen=True)
class InputFile:
    """One checked input: `kind` is text, jsonl or parquet; `compression` is gz, zst or None."""

    path: Path
    kind: str
    compression: str | None = None

    @property
    def size(self) -> int:
        return self.path.stat().st_size


@dataclasses.dataclass(frozen=True)
class Batch:
    """Texts to encode together: a document ends after `texts[i]` where `ends[i]`; `position` is how many bytes of
    the file on disk have been read (for the progress line)."""

    texts: list[str]
    ends: list[bool]
    position: int


def input_file(path: Path, text_key: str) -> InputFile:
    """The format of `path`, from its name, with its first bytes checked (and a parquet file's text column).

    Raises:
        ShardkitError: a missing file, an unknown suffix, content that is not what the name says, or no text column.
    """
    if not path.is_file():
        raise ShardkitError("INPUT", f"no file at {str(path)!r}")
    suffixes = [""] * 2 + [suffix.lower() for suffix in path.suffixes]
    compression = suffixes[-1][1:] if suffixes[-1] in (".gz", ".zst") else None
    kind = KINDS.get(suffixes[-2] if compression else suffixes[-1])
    if kind is None or (compression and kind == "parquet"):
        raise ShardkitError("INPUT", f"cannot read {path.name!r}; give {ACCEPTED}")
    _check_magic(path, compression or kind)
    if compression == "zst":
        optional_module("zstandard", path)
    if kind == "parquet":
        _check_text_column(path, text_key)
    return InputFile(path, kind, compression)


def _check_magic(path: Path, expected: str) -> None:
    with open(path, "rb") as handle:
        head = handle.read(4)
    found = next((name for name, magic in MAGIC.items() if head.startswith(magic)), None)
    wanted = expected if expected in MAGIC else None
    if found != wanted:
        what = f"{found} data" if found else "not " + expected
        raise ShardkitError("INPUT", f"{path} is {what}; name a file by its format: {ACCEPTED}")


def optional_module(name: str, path: Path) -> ModuleType:
    """pyarrow or zstandard, which only some formats need (`pip install 'shardkit[data]'`)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        needed = name.split(".")[0]
        raise ShardkitError("INPUT", f"reading {path.name} needs {needed}: pip install 'shardkit[data]'") from None


def _check_text_column(path: Path, text_key: str) -> None:
    pa, pq = optional_module("pyarrow", path), optional_module("pyarrow.parquet", path)

    try:
        schema = pq.read_schema(path)
    except pa.ArrowException as err:
        raise ShardkitError("INPUT", f"{path} is not a readable parquet file: {err}") from None
    if text_key not in schema.names:
        raise ShardkitError("--text-key", f"{path} has no column {text_key!r}; its columns: {schema.names}")
    column = schema.field(text_key).type
    if not (pa.types.is_string(column) or pa.types.is_large_string(column)):
        raise ShardkitError("--text-key", f"column {text_key!r} of {path} holds {column}, not strings")


def batches(source: InputFile, text_key: str) -> Iterator[Batch]:
    """The file's texts, in order, in batches of about BATCH_BYTES."""
    if source.kind == "parquet":
        yield from _parquet_batches(source.path, text_key)
        return
    with _opened(source) as (handle, raw):
        if source.kind == "jsonl":
            yield from _jsonl_batches(handle, raw, source.path, text_key)
        else:
            yield from _text_batches(handle, raw)


@contextmanager
def _opened(source: InputFile) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """(decompressed stream, the raw file under it): the raw file's position is how far the reading has come."""
    with open(source.path, "rb") as raw:
        if source.compression == "gz":
            yield gzip.GzipFile(fileobj=raw), raw
        elif source.compression == "zst":
            zstandard = optional_module("zstandard", source.path)
            yield io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw)), raw
        else:
            yield raw, raw


def _text_batches(handle: BinaryIO, raw: BinaryIO) -> Iterator[Batch]:
    """One document in pieces of whole lines, so that no word (or UTF-8 sequence) is cut in two."""
    pieces: list[str] = []
    while piece := _read_piece(handle):
        pieces.append(piece.decode("utf-8", errors="replace"))
        if len(pieces) * PIECE_BYTES >= BATCH_BYTES:
            yield Batch(pieces, [False] * len(pieces), raw.tell())
            pieces = []
    pieces = pieces or [""]  # the document ends here, even an empty one
    yield Batch(pieces, [False] * (len(pieces) - 1) + [True], raw.tell())


def _read_piece(handle: BinaryIO) -> bytes:
    """About PIECE_BYTES of whole lines, cut before a line that starts with a visible character where one comes soon:
    pre-tokenizers join runs of whitespace across lines (Llama 3's splits "\\n\\n" as one token), so a cut inside such a
    run would encode differently from the whole file, while a cut before a visible character does not."""
    piece = handle.read(PIECE_BYTES)
    if not piece:
        return piece
    piece += handle.readline()
    while len(piece) < MAX_PIECE_BYTES and (following := handle.peek(1)[:1]) and following.isspace():
        piece += handle.readline()
    return piece


def _jsonl_batches(handle: BinaryIO, raw: BinaryIO, path: Path, text_key: str) -> Iterator[Batch]:
    texts, size = [], 0
    for number, line in enumerate(handle, start=1):
        if line.strip():
            texts.append(_jsonl_text(line, text_key, path, number))
            size += len(line)
        if size >= BATCH_BYTES:
            yield Batch(texts, [True] * len(texts), raw.tell())
            texts, size = [], 0
    yield Batch(texts, [True] * len(texts), raw.tell())


def _jsonl_text(line: bytes, key: str, path: Path, number: int) -> str:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ShardkitError("INPUT", f"{path}:{number} is not a JSON object") from None
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        raise ShardkitError("--text-key", f"{path}:{number} has no string field {key!r}")
    return record[key]


def _parquet_batches(path: Path, text_key: str) -> Iterator[Batch]:
    parquet = optional_module("pyarrow.parquet", path).ParquetFile(path)
    rows, done, size = parquet.metadata.num_rows, 0, path.stat().st_size
    for record_batch in parquet.iter_batches(batch_size=4096, columns=[text_key]):
        texts = record_batch.column(0).to_pylist()
        if None in texts:
            row = done + texts.index(None)
            raise ShardkitError("--text-key", f"{path}: row {row} of column {text_key!r} is null")
        done += len(texts)
        yield Batch(texts, [True] * len(texts), size * done // max(rows, 1))
