"""Every path a command writes is checked before any work (shardkit.run.outputs): a missing parent, a file where a
directory belongs, no permission, no space: one line naming the flag, exit 2, nothing written."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shardkit.cli import main
from shardkit.errors import ShardkitError
from shardkit.run import outputs
from shardkit.run.outputs import check_output_dir, check_output_file

# Directories that refuse new files even to root (permission bits alone do not stop root).
UNWRITABLE = [path for path in ("/proc", "/sys") if Path(path).is_dir()]
FAST_S = 20  # the check runs before JAX compiles anything


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    return path


def test_a_directory_may_be_new_with_missing_parents(tmp_path):
    check_output_dir("--out", tmp_path / "runs" / "exp1")
    check_output_dir("--out", tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone; nothing made


def test_a_file_in_the_way_of_a_directory(a_file):
    with pytest.raises(ShardkitError, match="is a file"):
        check_output_dir("--out", a_file)
    with pytest.raises(ShardkitError, match="which is a file"):
        check_output_dir("--out", a_file / "run")


def test_a_file_needs_its_directory(tmp_path, a_file):
    check_output_file("--html", tmp_path / "page.html")
    with pytest.raises(ShardkitError, match="does not exist"):
        check_output_file("--html", tmp_path / "missing" / "page.html")
    with pytest.raises(ShardkitError, match="is a file"):
        check_output_file("--html", a_file / "page.html")
    with pytest.raises(ShardkitError, match="is a directory"):
        check_output_file("--html", tmp_path)


@pytest.mark.parametrize("root", UNWRITABLE)
def test_no_permission(root):
    with pytest.raises(ShardkitError, match="takes no new files"):
        check_output_dir("--out", f"{root}/x")
    with pytest.raises(ShardkitError, match="takes no new files"):
        check_output_file("--gantt", f"{root}/x.svg")


def test_no_space(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 0})())
    for check, path in ((check_output_dir, tmp_path / "run"), (check_output_file, tmp_path / "page.html")):
        with pytest.raises(ShardkitError, match="no space left"):
            check("--out", path)


def _refused(argv, capsys, flag):
    began = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"shardkit: error: {flag}: "), err
    assert time.monotonic() - began < FAST_S
    return err


@pytest.mark.parametrize("argv, flag", [
    (["plan", "recipes/fsdp.toml", "--html", "{missing}/x.html"], "--html"),
    (["plan", "recipes/pp.toml", "--gantt", "{missing}/x.svg"], "--gantt"),
    (["suggest", "recipes/fsdp.toml", "--target", "h100x8", "--write", "{missing}/best.toml"], "--write"),
    (["suggest", "recipes/fsdp.toml", "--target", "h100x8", "--html", "{file}/x.html"], "--html"),
    (["train", "recipes/fsdp.toml", "--out", "{file}/run"], "--out"),
    (["hlo", "recipes/fsdp.toml", "--out", "{file}"], "--out"),
    (["export", "{tmp}", "--to", "{file}/export"], "--to"),
    (["import-hf", "{tmp}", "--out", "{file}"], "--out"),
    (["data", "prepare", "{file}", "--tokenizer", "{file}", "--out", "{file}/data"], "--out"),
])
def test_every_command_checks_its_outputs_first(argv, flag, tmp_path, a_file, capsys):
    names = {"missing": tmp_path / "missing", "file": a_file, "tmp": tmp_path}
    _refused([arg.format(**names) for arg in argv], capsys, flag)
    assert sorted(tmp_path.iterdir()) == [a_file] and a_file.read_text() == "mine"


@pytest.mark.parametrize("root", UNWRITABLE)
def test_train_into_an_unwritable_directory_is_one_line(root, capsys):
    _refused(["train", "recipes/fsdp.toml", "--out", f"{root}/x"], capsys, "--out")
