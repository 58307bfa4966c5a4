"""What a newcomer's first hour relies on: the light quickstart install, the bounded JAX range, the licence and the
contributor files, and the shipped text with its provenance.

The Makefile is read with `make -n` (print, do not run): `make train` installs shardkit alone (CPU JAX, no test extra,
no CUDA plugin), `make test` installs the test extra, also into a .venv that `make train` made (separate stamps)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tomllib

import jax
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _planned(target: str, venv, *settings: str) -> str:
    """The commands `make TARGET` would run with this .venv, printed and not run."""
    result = subprocess.run(["make", "-n", target, f"VENV={venv}", "CHROMIUM=/bin/sh", *settings], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@needs_make
def test_make_train_installs_shardkit_alone_and_make_test_the_test_extra(tmp_path):
    fresh = _planned("train", tmp_path / "venv")
    assert "pip install --quiet -e .\n" in fresh and "[test]" not in fresh and "cuda" not in fresh, fresh
    assert "shardkit train recipes/fsdp.toml" in fresh and "data.path=data/alice.txt" in fresh
    assert "--steps 300" in fresh and "--steps 600" in _planned("train", tmp_path / "venv", "STEPS=600")
    # A .venv that `make train` made (its stamp newer than pyproject.toml): `make test` still installs the test extra.
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / ".train").touch()
    upgrade = _planned("test", tmp_path / "venv")
    assert "pip install --quiet -e '.[test]'" in upgrade and "pytest" in upgrade, upgrade
    assert "pip install --quiet -e .\n" not in _planned("train", tmp_path / "venv")  # train's stamp is current


def test_the_base_install_has_no_cuda_and_the_test_extra_has_the_plugin():
    base = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    assert not any(r.extras for r in base) and not any("nvidia" in r.name or "cuda" in r.name for r in base)
    test = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]]
    assert any(r.name == "jax" and "cuda12" in r.extras for r in test)
    assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= {r.name for r in test}


def test_jax_is_bounded_to_the_tested_versions_and_this_one_is_inside():
    extras = PYPROJECT["project"]["optional-dependencies"]
    pins = [r for r in map(Requirement, PYPROJECT["project"]["dependencies"] + extras["cuda12"] + extras["cuda13"]
                           + extras["test"]) if r.name == "jax"]
    assert len(pins) == 4
    for pin in pins:
        assert any(spec.operator == "<" for spec in pin.specifier), f"{pin} has no upper bound"
        assert Version(jax.__version__) in pin.specifier, f"the installed jax {jax.__version__} is outside {pin}"


def test_licence_and_contributor_files():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    for part in ("## Set-up", "make test-fast", "make test", "## Style", "## Adding a recipe", "## Adding a layout",
                 "## Adding a model"):
        assert part in contributing, f"CONTRIBUTING.md lacks {part!r}"
    assert "## Unreleased" in (ROOT / "CHANGELOG.md").read_text()


def test_the_shipped_text_is_the_one_its_provenance_names():
    text = (ROOT / "data" / "alice.txt").read_bytes()
    provenance = (ROOT / "data" / "README.md").read_text()
    assert "public domain" in provenance and "brotli-1.2.1.tar.gz" in provenance
    assert hashlib.sha256(text).hexdigest().startswith("4cbce865") and "4cbce865" in provenance
    assert b"\r" not in text and text.isascii() and 100_000 < len(text) < 1_000_000
