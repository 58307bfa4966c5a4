"""The README's "what happens when" table, run as a user would: the real command in a subprocess, files corrupted the
way the table says; the refusals (bad input, no readable checkpoint) and a finished run's "nothing to run", which
train nothing, through the CLI's entry in this process. (kill -9, SIGTERM and Ctrl-C are in test_preemption.py; NaN
losses in test_checkpoint.py.)

Subprocesses are slow (JAX import, compile), so one trained run directory is shared by the module and several faults
are put into one copy of it where each is still checked on its own: three checkpoints broken three ways plus a torn
metrics line are all met by one resume; the disk-full run is that same resume under a file-size limit; the run that
takes a stale lock over also meets a newest checkpoint whose data files were cut short.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardkit.cli import main
from tests.helpers import ROOT, fresh_process_env

pytestmark = pytest.mark.slow  # every test runs `shardkit train` in fresh processes

PROCESS_TIMEOUT_S = 300
FAST_EXIT_S = 30.0  # bad input is refused before any compile: JAX's import and a recipe load, on a loaded CI machine
SAVE_LIMIT_BYTES = 64 * 1024  # above metrics.jsonl and the lock file, below a checkpoint's array data file
ENDLESS_STEPS = 100_000  # a run that is still training when the test kills it


def _command(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "shardkit", "train", str(ROOT / "recipes" / "fsdp.toml"), "--devices", "2",
        "--out", str(out), "--steps", str(steps), "--set", "checkpoint.every=2", "--set", "checkpoint.keep=4",
        "--set", "train.global_batch=8", "--set", "train.seq_len=16", *extra,  # cheap steps: the faults are in files
    ]


def _run(command: list[str], limit_file_size: bool = False) -> subprocess.CompletedProcess:
    """The command in a fresh process; with `limit_file_size`, every file it writes is capped (a full disk)."""
    env = fresh_process_env()  # the suite's compile-time flags kept: the runs of 8 steps share one compiled step
    if limit_file_size:
        command = [sys.executable, "-c", CAP_FILE_SIZE, *command]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)


# RLIMIT_FSIZE, then exec the command: a write past the cap fails with EFBIG as a write to a full disk fails with
# ENOSPC. SIGXFSZ, which would kill the process instead, is ignored (an ignored signal stays ignored across exec).
CAP_FILE_SIZE = f"""
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({SAVE_LIMIT_BYTES}, {SAVE_LIMIT_BYTES}))
os.execv(sys.argv[1], sys.argv[1:])
"""


def _assert_one_error_line(result: subprocess.CompletedProcess, field: str, *fragments: str) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("shardkit: error:") or "ERROR" in line]
    assert len(errors) == 1 and errors[0] == lines[-1], result.stderr[-3000:]  # progress and warnings may precede it
    assert errors[0].startswith(f"shardkit: error: {field}:"), errors[0]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[dict]]:
    """8 steps with checkpoints at 2, 4, 6 and 8: the run directory and its metrics."""
    out = tmp_path_factory.mktemp("trained") / "run"
    result = _run(_command(out, 8))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "4", "6", "8"]
    return out, _records(out)


def _break_checkpoints(out: Path) -> None:
    """Step 8's meta is not JSON, step 6 lost its manifest.ocdbt, step 4's array files are truncated; 2 is intact;
    metrics.jsonl ends in a line torn by a kill mid-write."""
    checkpoints = out / "checkpoints"
    (checkpoints / "8" / "meta" / "metadata").write_text('{"format": 1, "model": "lla')
    (checkpoints / "6" / "state" / "manifest.ocdbt").unlink()
    for data_file in (checkpoints / "4" / "state").rglob("d/*"):
        os.truncate(data_file, data_file.stat().st_size // 2)
    with (out / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 8, "loss": 3.9')


def test_broken_checkpoints_are_skipped_and_a_failed_save_keeps_the_last_good_one(trained, tmp_path):
    reference_dir, reference = trained
    out = tmp_path / "run"
    shutil.copytree(reference_dir, out)
    _break_checkpoints(out)

    keep_one = ("--set", "checkpoint.keep=1")  # the strictest keep: step 2 must survive until a newer save commits
    full = _run(_command(out, 8, *keep_one), limit_file_size=True)  # the first save after the resume meets a full disk
    error = _assert_one_error_line(full, "checkpoint", "writing the checkpoint of step 4", "File too large",
                                   "the newest complete checkpoint is step 2")
    assert sorted(name for name in os.listdir(out / "checkpoints") if name.isdigit()) == ["2"], error
    _assert_skipped_three(full.stderr, out)

    rerun = _run(_command(out, 8, *keep_one))  # disk space freed: the same command
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Traceback" not in rerun.stderr and "Event loop is closed" not in rerun.stderr, rerun.stderr[-3000:]
    assert "resuming from the checkpoint at step 2" in rerun.stderr
    records = _records(out)
    assert [record["step"] for record in records] == list(range(1, 9))  # the torn line is gone, the run reads as one
    assert [r["loss"] for r in records] == [r["loss"] for r in reference]  # resumed exactly
    names = sorted(os.listdir(out / "checkpoints"))  # steps 4-8 saved again (keep=1 left 8) beside the unreadable ones
    assert names == ["4.unreadable", "6.unreadable", "8", "8.unreadable"], names


def _assert_skipped_three(stderr: str, out: Path) -> None:
    warnings = [line for line in stderr.splitlines() if line.startswith("warning: skipped the checkpoint")]
    assert len(warnings) == 3, stderr[-3000:]
    assert warnings[0].startswith("warning: skipped the checkpoint at step 8: meta/metadata is not readable JSON")
    assert warnings[1].startswith("warning: skipped the checkpoint at step 6: its state cannot be read")
    assert warnings[2].startswith("warning: skipped the checkpoint at step 4: its state cannot be read")
    for step, warning in zip((8, 6, 4), warnings):
        assert warning.endswith(f"kept it as {out / 'checkpoints' / f'{step}.unreadable'}"), warning
        assert (out / "checkpoints" / f"{step}.unreadable").is_dir()
    assert "resuming from the checkpoint at step 2" in stderr
    assert "Traceback" not in stderr and "Event loop is closed" not in stderr, stderr[-3000:]


def test_no_readable_checkpoint_exits_2_naming_the_directory(trained, tmp_path, capsys):
    """A refusal: through the CLI's entry in this process, on its 8 devices (a checkpoint resumes onto another
    layout)."""
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    for step in ("2", "4", "6", "8"):
        (out / "checkpoints" / step / "state" / "manifest.ocdbt").unlink()
    result = _main(_in_this_process(_command(out, 8)), capsys)
    _assert_one_error_line(result, "--out", f"no readable checkpoint in {out / 'checkpoints'}", "step 2:")
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "4", "6", "8"]  # nothing moved, nothing deleted


def test_a_run_its_checkpoint_already_finished_has_nothing_to_run(trained, tmp_path, capsys):
    """The same command once more: the checkpoint reaches its steps, so nothing is compiled, trained or saved."""
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    result = _main(_in_this_process(_command(out, 8)), capsys)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nothing to run" in result.stderr and "compiled the step" not in result.stderr, result.stderr
    assert _records(out) == trained[1] and sorted(os.listdir(out / "checkpoints")) == ["2", "4", "6", "8"]


def _in_this_process(command: list[str]) -> list[str]:
    """A `_command` for `shardkit.cli.main` in this process: without `python -m shardkit` and `--devices 2` (this
    process has the suite's 8 devices, and the batch of 8 rows splits over them)."""
    args = command[3:]
    at = args.index("--devices")
    return args[:at] + args[at + 2:]


def _main(args: list[str], capsys) -> subprocess.CompletedProcess:
    """`shardkit ARGS` run in this process (`shardkit.cli.main`), its exit code and output as `_run` returns them."""
    capsys.readouterr()
    code = main(args)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def test_bad_devices_out_and_data_are_refused_at_once(tmp_path, capsys):
    """Refusals, not process behaviour: run in this process (`_in_this_process`; the checks come before any layout
    is compiled)."""
    recipe = str(ROOT / "recipes" / "fsdp.toml")
    began = time.monotonic()
    typo = _main(["plan", recipe, "--devices", "100000", "--no-compile"], capsys)
    _assert_one_error_line(typo, "--devices", "1..1024")
    assert time.monotonic() - began < FAST_EXIT_S
    mesh = _main(["plan", str(ROOT / "recipes" / "tp.toml"), "--devices", "6", "--set", "mesh.data=2"], capsys)
    _assert_one_error_line(mesh, "--devices", "needs 8 devices, got 6")

    def train(out: Path, *extra: str) -> list[str]:
        return _in_this_process(_command(out, 2, *extra))

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    taken = _main(train(a_file), capsys)
    _assert_one_error_line(taken, "--out", "is a file")
    assert a_file.read_text() == "mine"

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.bin"
    short.write_bytes(bytes(2 * 16))  # 16 uint16 tokens; a row needs seq_len + 1 = 17 and a window to move in
    for overrides, fragment in [
        (["data.source=text", f"data.path={empty}"], "is empty"),
        (["data.source=bin", f"data.path={short}", "data.dtype=uint16"], "holds 16 tokens"),
    ]:
        out = tmp_path / "run"
        result = _main(train(out, *[item for o in overrides for item in ("--set", o)]), capsys)
        _assert_one_error_line(result, "data.path", fragment)
        assert not out.exists()


def test_a_second_train_on_the_same_out_is_refused_and_a_stale_lock_taken_over(trained, tmp_path):
    """The first run holds the lock once its step has compiled (a step that cannot fit writes nothing, not even the
    lock); it is stopped (SIGSTOP: alive, holding the lock, training no further) as soon as the lock names it, and
    killed after the second run is refused. The third run takes the stale lock over and, as the newest checkpoint's
    data files were cut to 64 bytes meanwhile, skips that checkpoint with one warning naming the step and why; the
    failed restore's abandoned reads print nothing, then or later in the run."""
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    log = tmp_path / "first.log"
    endless = _command(out, ENDLESS_STEPS, "--set", "checkpoint.every=0")  # no save before the kill
    first = subprocess.Popen(endless, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + PROCESS_TIMEOUT_S
        while not _lock_names(out, first.pid):
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)
        second = _run(endless)
        _assert_one_error_line(second, "--out", f"pid {first.pid} on host {socket.gethostname()}")
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
    assert _lock_names(out, first.pid)  # what kill -9 leaves behind
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "4", "6", "8"]
    for data_file in (out / "checkpoints" / "8" / "state").rglob("d/*"):
        os.truncate(data_file, 64)
    third = _run(_command(out, 8))  # resumes at 6: two steps run after the skip
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over train.lock left by pid {first.pid}" in third.stderr, third.stderr
    assert not (out / "train.lock").exists()  # released at the end
    for text in (third.stdout, third.stderr):
        assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]
    lines = third.stderr.splitlines()
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: skipped the checkpoint at step 8: its state cannot "
                                                         "be read (OUT_OF_RANGE"), third.stderr
    expected = ("took over train.lock", "warning: skipped", "resuming from the checkpoint at step 6",
                "compiled the step in", "step ")
    assert all(line.startswith(expected) for line in lines if line.strip()), third.stderr
    assert [record["step"] for record in _records(out)] == list(range(1, 9))


def _lock_names(out: Path, pid: int) -> bool:
    try:
        return json.loads((out / "train.lock").read_text())["pid"] == pid
    except (OSError, ValueError):
        return False  # not there yet, or being written
