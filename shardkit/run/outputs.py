"""Output paths checked before any work: a command that would fail to write its result after minutes of compiling
says so at once, in one line naming the flag.

Two kinds of output:
- a directory (a run directory, `hlo --out`, `export --to`, `data prepare --out`): it exists as a directory, or it can
  be made one, missing parents included (`--out runs/exp1` makes `runs/`), because its nearest existing ancestor is
  a directory;
- a file (a page, a chart, a recipe): its parent directory exists, and the path itself is not a directory.
In both cases the directory written into must take a new file (probed by creating and removing one, which also
catches what permission bits do not show: a read-only mount, /proc, root on a read-only file system) and have at
least `MIN_FREE_BYTES` free.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from shardkit.errors import ShardkitError

MIN_FREE_BYTES = 1 << 20  # below this not even a metrics line and a recipe fit; a full disk reads as 0


def check_output_dir(field: str, path: str | Path) -> None:
    """Refuse a directory output that cannot be created or written (see the module note).

    Raises:
        ShardkitError: naming `field`: a file in the way, no permission, or no space left.
    """
    path = Path(path)
    existing = _nearest_existing(path)
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under {str(existing)!r}, which is a file"
        raise ShardkitError(field, f"{str(path)!r} {where}; give a directory (new, or one to write into)")
    _check_room(field, path, existing)


def check_output_file(field: str, path: str | Path) -> None:
    """Refuse a file output whose directory is missing, that names a directory, or that cannot be written.

    Raises:
        ShardkitError: naming `field`.
    """
    path = Path(path)
    if path.is_dir():
        raise ShardkitError(field, f"{str(path)!r} is a directory; give a file name in it")
    parent = path.parent
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise ShardkitError(field, f"cannot write {str(path)!r}: its directory {str(parent)!r} {what}; give a file "
                                   "in an existing directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise ShardkitError(field, f"cannot write {str(path)!r}: permission denied")
    _check_room(field, path, parent)


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.absolute().parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor or "/")


def _check_room(field: str, path: Path, directory: Path) -> None:
    """A new file can be made in `directory` and its file system has space left."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".shardkit-write-check-"):
            pass
    except OSError as err:
        reason = err.strerror or str(err)
        raise ShardkitError(field, f"cannot write {str(path)!r}: {str(directory)!r} takes no new files "
                                   f"({reason})") from None
    free = shutil.disk_usage(directory).free
    if free < MIN_FREE_BYTES:
        raise ShardkitError(field, f"cannot write {str(path)!r}: no space left on the file system of "
                                   f"{str(directory)!r} ({free:,} bytes free)")
