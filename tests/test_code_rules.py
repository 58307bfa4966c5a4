"""Rules shardkit's code keeps as it grows: modules small enough to read, one job each."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "shardkit"
MAX_MODULE_LINES = 700


def test_no_module_over_the_line_limit():
    long = {str(path.relative_to(ROOT)): count for path in sorted(PACKAGE.rglob("*.py"))
            if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


# What a comment or docstring in shardkit/ must not quote: a size read off a compile, a before/after ratio, a date or
# an issue number. History lives in commit messages, figures in tests and bench/results/. Examples of output and
# input formats in backticks or quotes are left out, and so are rates (GB/s).
FIGURE_PATTERNS = {
    "a size": re.compile(r"(?<![\w.])\d[\d,]*(\.\d+)? (KiB|MiB|GiB|TiB|KB|MB|GB)\b(?!/s)"),
    "a before -> after": re.compile(r"\d\s*(->|→)\s*\d"),
    "an issue number": re.compile(r"\bissues?[ -]\d+", re.IGNORECASE),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a ratio to a compiled figure": re.compile(r"\b\d\.\d\d of (XLA|the compiled|the live|measured)"),
}
# Contracts, not measurements: the GPU specifications `--target` compiles for and the memory limits it fits against,
# each with its source beside it.
FIGURE_ALLOWED = {("shardkit/analysis/predicted/targets.py", "a size")}
QUOTED = re.compile(r"`[^`]*`|\"[^\"]*\"")


def comment_lines(path: Path):
    """(line number, text) of every comment and docstring line of a module."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if ast.get_docstring(node, clean=False) is not None:
                first = node.body[0]
                for offset, line in enumerate(first.value.value.split("\n")):
                    yield first.lineno + offset, line


def figure_quotes(path: Path) -> list[str]:
    name = str(path.relative_to(ROOT))
    found = []
    for number, line in comment_lines(path):
        text = QUOTED.sub("", line)
        for what, pattern in FIGURE_PATTERNS.items():
            if (name, what) not in FIGURE_ALLOWED and pattern.search(text):
                found.append(f"{name}:{number}: {what}: {line.strip()}")
    return found


def test_figure_patterns_catch_what_they_should():
    quoted = ["(h100x8: 289 KiB each)", "0.81 -> 0.930", "(issue 23)", "on 2026-11-27", "0.94 of XLA's peak"]
    for text in quoted:
        assert any(p.search(QUOTED.sub("", text)) for p in FIGURE_PATTERNS.values()), text
    for text in ["`fits: 39.65 GiB needed`", "450 GB/s one way", "Narayanan et al. 2021", "backward 2.5x"]:
        assert not any(p.search(QUOTED.sub("", text)) for p in FIGURE_PATTERNS.values()), text


def test_no_comment_quotes_a_measured_figure_a_date_or_an_issue():
    found = [quote for path in sorted(PACKAGE.rglob("*.py")) for quote in figure_quotes(path)]
    assert not found, ("comments and docstrings state contracts; figures go to tests or bench/results/, history to "
                       "commit messages:\n" + "\n".join(found))


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers.py (and tests/equivalence.py's traces), not in another test module."""
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name} imports {name}" for name in names if name.startswith("tests.test_")]
    assert not found, found


def test_the_suites_heaviest_first_order_names_existing_modules():
    """tests/conftest.py runs the modules it names first (make test's xdist workers then finish on cheap ones); a name
    left behind by a rename would silently send that module back to the end of the queue."""
    from tests.conftest import HEAVIEST_FIRST

    modules = {path.name for path in (ROOT / "tests").rglob("test_*.py")}
    assert len(set(HEAVIEST_FIRST)) == len(HEAVIEST_FIRST)
    assert not set(HEAVIEST_FIRST) - modules, set(HEAVIEST_FIRST) - modules
