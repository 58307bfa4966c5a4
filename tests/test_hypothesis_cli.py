"""Property: whatever a recipe file and `--set` overrides say, `shardkit plan --no-compile` exits 0, or exits 2 with
one line naming a field, and never prints a traceback; each example within a time bound.

Values are drawn to break things: wrong types, negatives, zero, huge numbers, empty and unicode strings, unknown
sections and keys, lists and tables where scalars belong. The CLI runs in this process (`shardkit.cli.main`), on the
8 fake devices tests/conftest.py set up, so 200 examples cost seconds, not 200 JAX imports. On failure hypothesis
prints the failing example and how to reproduce it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import tempfile
import tomllib
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shardkit import cli
from shardkit.recipe import SECTIONS
from tests.helpers import RECIPES

EXAMPLES = 200
DEADLINE = timedelta(seconds=10)  # a plan without compiling takes well under a second; a hang or a blow-up does not
KEYS = {
    section: sorted(field.name for field in dataclasses.fields(cls)) for section, cls in SECTIONS.items()
}
KEYS["model"] += ["layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab"]  # dimensions by logical name
KEYS["rules"] += ["params.embed", "params.mlp", "activations.batch"]
BASE_RECIPES = sorted(path.name for path in RECIPES.glob("*.toml"))

PLAUSIBLE_INTS = st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, -1])  # values that often pass, to reach deeper code
NASTY_INTS = st.sampled_from([0, -2, 3, 7, 2**31, 2**63, 10**30, -(10**30)]) | st.integers(-10, 100)
NASTY_FLOATS = st.sampled_from([0.0, -0.0, 1e-300, 1e300, float("inf"), float("-inf"), float("nan"), 0.5, -3.5])
NASTY_TEXT = st.text(max_size=12) | st.sampled_from(
    ["", " ", "é", "数据", "fsdp", "embed", "float32", "bf16", "1f1b", "per_step", "\u202e"]
)
SCALARS = PLAUSIBLE_INTS | NASTY_INTS | NASTY_FLOATS | NASTY_TEXT | st.booleans()
VALUES = SCALARS | st.lists(SCALARS, max_size=3) | st.dictionaries(NASTY_TEXT, SCALARS, max_size=2)


@st.composite
def dotted_keys(draw) -> str:
    """`section.key`: nine in ten real ones, the rest unknown sections or keys."""
    real = draw(st.integers(0, 9)) > 0
    section = draw(st.sampled_from(sorted(KEYS)) if real else NASTY_TEXT)
    key = draw(st.sampled_from(KEYS.get(section, ["steps"])) if real else NASTY_TEXT)
    return f"{section}.{key}"


def _override_text(value) -> str:
    """A `--set` value as a user might type it: TOML-ish for lists/tables, plain for scalars."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return repr(value)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, float):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(value), repr(value))
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _recipe_text(base: str, entries: list[tuple[str, object]]) -> str:
    """The base recipe with the drawn values written into its tables, as one TOML document."""
    tables = tomllib.loads((RECIPES / base).read_text())
    for dotted, value in entries:
        section, _, key = dotted.partition(".")
        table = tables.setdefault(section, {})
        if isinstance(table, dict):
            table[key] = value
    return "".join(_toml_table(section, table) for section, table in tables.items())


def _toml_table(section: str, table: dict) -> str:
    lines = [f"{json.dumps(key)} = {_toml_value(value)}\n" for key, value in table.items()]
    return f"[{json.dumps(section)}]\n" + "".join(lines)


def _plan(argv: list[str]) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:  # argparse's --help and friends
            code = exit_.code
    return code, stdout.getvalue(), stderr.getvalue()


@settings(
    max_examples=EXAMPLES, deadline=DEADLINE,
    print_blob=True, database=None,  # a failure prints its @reproduce_failure line; no .hypothesis/ left in the tree
    # The same examples on every run, so CI cannot fail on a draw it never saw before; set it False locally to
    # explore new draws (that is how the 2**63 case below was found).
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    base=st.sampled_from(BASE_RECIPES),
    in_file=st.lists(st.tuples(dotted_keys(), VALUES), max_size=2),
    overrides=st.lists(st.tuples(dotted_keys(), VALUES), max_size=3),
    # one in eight: any of them is refused at once, so more would keep the rest from reaching deeper code
    raw_overrides=st.integers(0, 7).flatmap(lambda n: st.tuples(NASTY_TEXT) if n == 0 else st.just(())),
)
def test_plan_exits_0_or_2_with_one_line(base, in_file, overrides, raw_overrides):
    with tempfile.TemporaryDirectory() as directory:
        recipe = Path(directory) / "recipe.toml"
        recipe.write_text(_recipe_text(base, in_file))
        argv = ["plan", str(recipe), "--no-compile"]
        for dotted, value in overrides:
            argv += ["--set", f"{dotted}={_override_text(value)}"]
        for raw in raw_overrides:  # no `=`, or nothing but one
            argv += ["--set", raw]
        code, out, err = _plan(argv)
    event(f"exit {code}" + (f" ({err.split(': ')[2]})" if code == 2 else ""))  # --hypothesis-show-statistics
    assert "Traceback" not in err and "Traceback" not in out
    if code == 0:
        assert out.strip() and not err.strip(), err
        return
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardkit: error: "), err


@pytest.mark.parametrize("value", ["0", "9223372036854775808", "2147483648"])
def test_a_model_dimension_out_of_range_is_one_line(value):
    """Found by the search above (cp.toml, model.layers = 2**63): JAX failed inside tracing on a dimension past
    int64."""
    code, out, err = _plan(["plan", "recipes/cp.toml", "--no-compile", "--set", f"model.layers={value}"])
    assert code == 2 and err.strip().splitlines() == [err.strip()], err
    assert err.startswith("shardkit: error: model.layers: must be in 1..2147483647"), err
