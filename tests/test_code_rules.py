"""Rules shardkit's code keeps as it grows: modules small enough to read, one job each."""

from __future__ import annotations

from tests.helpers import ROOT

PACKAGE = ROOT / "shardkit"
MAX_MODULE_LINES = 700


def test_no_module_over_the_line_limit():
    long = {str(path.relative_to(ROOT)): count for path in sorted(PACKAGE.rglob("*.py"))
            if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"
