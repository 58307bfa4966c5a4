"""The built wheel is a shardkit that trains: models and recipes inside the package, recipes usable by name.

No network here, so the venv cannot download jax and flax: the wheel is installed with `--no-deps`, and a `.pth` file
makes the development venv's site-packages (jax, flax, optax, ...) visible behind it. The development venv's editable
install of shardkit has its own finder there too, so the test asserts that the `shardkit` the new venv imports is the
wheel's copy inside the new venv, not the source tree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import ROOT, fresh_process_env

pytestmark = pytest.mark.slow


def _run(argv, cwd, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{argv}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv outside the repository with only the wheel installed."""
    root = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", str(ROOT), "-w", str(root / "dist")], cwd=root)
    wheel = next((root / "dist").glob("shardkit-*.whl"))
    env_dir = root / "venv"
    # Without a pip of its own (seeding one costs more than the rest of the set-up): the development venv's pip
    # installs into it (`--python`).
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=root)
    python = env_dir / "bin" / "python"
    # Without PYTHONPATH: a source tree on it, beside the egg-info the build leaves there, reads to pip as shardkit
    # already installed, and the wheel would be skipped.
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
         cwd=root, env=_clean_env())
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout
    Path(site.strip(), "shardkit_dev_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir


def _clean_env() -> dict:
    """No PYTHONPATH (it would put the source tree first) and no inherited fake-device settings (`fresh_process_env`:
    the suite's compile-time XLA flags and its compilation cache stay, as for every command the suite starts;
    `SHARDKIT_TEST_XLA_DEFAULTS=1` compiles as users compile)."""
    return {key: value for key, value in fresh_process_env().items() if key != "PYTHONPATH"}


def test_the_wheel_imports_its_own_copy(venv, tmp_path):
    probe = "import shardkit.models.llama, shardkit; print(shardkit.__file__)"
    location = _run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=_clean_env()).stdout.strip()
    assert Path(location).resolve().is_relative_to(venv.resolve()), location


def test_trains_a_builtin_recipe_by_name_from_an_empty_directory(venv, tmp_path):
    env = _clean_env()
    shardkit = str(venv / "bin" / "shardkit")
    assert _run([shardkit, "--version"], cwd=tmp_path, env=env).stdout.strip() == "shardkit 0.1.0"
    assert "fsdp_tp" in _run([shardkit, "recipes"], cwd=tmp_path, env=env).stdout
    _run([shardkit, "train", "fsdp", "--devices", "8", "--steps", "2", "--out", "run"], cwd=tmp_path, env=env)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2]
