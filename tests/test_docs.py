"""The README and the docs site: the site builds with `mkdocs build --strict` (no dead link or anchor, no page left out
of the nav), the README stays a front door, its CPU commands run, and the recipe reference lists every key of
shardkit/recipe.py with its default."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import subprocess
import sys

import pytest

from shardkit.recipe import SECTIONS, toml_value
from tests.helpers import ROOT, fresh_process_env

README = ROOT / "README.md"
RECIPE_REFERENCE = ROOT / "docs" / "reference" / "recipe.md"
COMMAND_REFERENCE = ROOT / "docs" / "reference" / "commands.md"
README_MAX_LINES = 300
CPU_BLOCK = re.compile(r"^```sh cpu\n(.*?)^```", re.MULTILINE | re.DOTALL)


# What a page would fetch from the network as it loads: a script, style sheet, image or frame by http(s) address, or a
# style sheet's url(...) or @import of one. Links a reader clicks (<a href>) are not loads.
NETWORK_LOAD = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=[\"']?(?:https?:)?//"
                          r"|url\(\s*[\"']?(?:https?:)?//|@import\s+[\"']?(?:https?:)?//", re.IGNORECASE)


def test_docs_site_builds_strict_and_works_offline(tmp_path):
    """`mkdocs build --strict` passes; the built site loads nothing from the network (highlighting, search and the
    theme's assets come with it), highlights code with Pygments at build time, and has the tutorial and the API
    reference in its nav."""
    pytest.importorskip("mkdocs", reason="the test extra installs mkdocs")
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=fresh_process_env() | {"PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    pages = [path for path in site.rglob("*") if path.suffix in (".html", ".css")]
    loads = [f"{path.relative_to(site)}: {match.group(0)}" for path in pages
             for match in NETWORK_LOAD.finditer(path.read_text(errors="replace"))]
    assert not loads, "the site loads from the network:\n" + "\n".join(loads[:20])
    start = (site / "tutorials" / "getting-started" / "index.html").read_text()
    assert '<span class="k">' in start or '<span class="nt">' in start, "no Pygments highlighting in the tutorial"
    assert (site / "search" / "search_index.json").is_file()
    api = (site / "reference" / "api" / "index.html").read_text()
    assert all(name in api for name in ("Trainer", "ModelProtocol", "use_test_devices", "load")), "API reference"


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move the detail into docs/"


def test_readme_links_exist():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def expected_recipe_rows() -> dict[str, str]:
    """`section.key` -> the start of its reference row: the key and its default as TOML writes it."""
    rows = {}
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            default = "none" if field.default is None else toml_value(field.default)
            rows[f"{section}.{field.name}"] = f"| `{section}.{field.name}` | `{default}` |"
    return rows


def test_recipe_reference_lists_every_key_with_its_default():
    text = RECIPE_REFERENCE.read_text()
    expected = expected_recipe_rows()
    missing = [row for row in expected.values() if row not in text]
    assert not missing, "docs/reference/recipe.md lacks (or has another default for):\n" + "\n".join(missing)
    documented = set(re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|", text, re.MULTILINE))
    unknown = documented - set(expected)
    assert not unknown, f"docs/reference/recipe.md names keys recipe.py lacks: {unknown}"


def readme_cpu_commands() -> list[str]:
    return [line for block in CPU_BLOCK.findall(README.read_text()) for line in block.splitlines() if line.strip()]


def test_readme_has_cpu_commands():
    assert readme_cpu_commands(), "README.md has no ```sh cpu block for tests/test_docs.py to run"


@pytest.mark.parametrize("command", readme_cpu_commands())
def test_readme_cpu_command_runs(command, monkeypatch, capsys):
    """Each command through the CLI's entry (`shardkit.cli.main`, what the `shardkit` script calls) in this process,
    from the repository root: its exit code is the property, and a `--devices 8` matches this process's devices."""
    from shardkit.cli import main

    argv = shlex.split(command)
    assert argv[0] == "shardkit", f"a ```sh cpu block runs shardkit commands only: {command}"
    monkeypatch.chdir(ROOT)
    code = main(argv[1:])
    captured = capsys.readouterr()
    assert code == 0, f"{command}\n{captured.out[-2000:]}\n{captured.err[-2000:]}"


def cli_flags() -> dict[str, list[str]]:
    """Every subcommand (`data prepare` included) -> its `--flags`, read off the CLI's parser."""
    from shardkit.cli import build_parser

    flags: dict[str, list[str]] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command, sub in action.choices.items():
                    walk(sub, f"{name} {command}".strip())
            else:
                flags.setdefault(name, []).extend(
                    s for s in action.option_strings if s.startswith("--") and s not in ("--help", "--version"))

    walk(build_parser(), "")
    return flags


def command_synopses() -> dict[str, str]:
    """The command reference's synopsis block: `shardkit COMMAND ...` with its indented continuation lines, by the
    text after `shardkit ` up to the first argument in capitals or brackets (`bench collectives`, `data prepare`)."""
    block = re.search(r"^```\n(.*?)^```", COMMAND_REFERENCE.read_text(), re.MULTILINE | re.DOTALL).group(1)
    synopses: dict[str, str] = {}
    name = None
    for line in block.splitlines():
        if line.startswith("shardkit "):
            words = re.match(r"shardkit ((?:[a-z][a-z-]* ?)+)", line).group(1).split()
            name = " ".join(words)
            synopses[name] = line
        elif name and line.startswith(" "):
            synopses[name] += " " + line.strip()
    return synopses


def test_every_cli_flag_is_in_the_command_reference():
    """The command reference cannot drift from the parser: a flag added to shardkit/cli.py without its place in the
    synopsis of its command in docs/reference/commands.md fails here, named with its command."""
    flags, synopses = cli_flags(), command_synopses()
    assert {"train", "plan", "bench", "data prepare", "generate"} <= set(flags)
    missing = []
    for command, names in flags.items():
        if not command:
            continue
        synopsis = next((text for name, text in synopses.items() if name == command or name.startswith(command + " ")),
                        None)
        if synopsis is None:
            missing.append(f"shardkit {command} (no synopsis line)")
            continue
        missing += [f"shardkit {command} {flag}" for flag in names if not re.search(rf"{re.escape(flag)}(?![\w-])",
                                                                                  synopsis)]
    assert not missing, "docs/reference/commands.md's synopses lack:\n" + "\n".join(missing)
