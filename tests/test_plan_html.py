"""`plan --html`: one self-contained page (parses, has the SVG parts, fetches nothing), and in a real browser (Debian's
Chromium driven by Playwright) the pages of a pipeline recipe and an MoE recipe render without console errors, with
every SVG label inside its SVG and no two labels overlapping.

The browser test skips where /usr/bin/chromium is missing, except under `make test` (which installs it and sets
SHARDKIT_REQUIRE_BROWSER=1): there a missing browser fails."""

from __future__ import annotations

import functools
import html
import html.parser
import os
import re
import tempfile
from pathlib import Path

import pytest

from shardkit.analysis.planning.plan_page import (
    STAGE_HEADING,
    communication_rows,
    communication_svg,
    memory_svg,
    stage_rows,
)
from shardkit.analysis.predicted.targets import cuda_plugin_available
from shardkit.cli import main


class _Collector(html.parser.HTMLParser):
    """Tags, attributes and nesting errors of a page."""

    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.attributes: list[tuple[str, str]] = []
        self.open: list[str] = []
        self.unbalanced: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attributes += [(name, value or "") for name, value in attrs]
        if tag not in ("meta", "br", "img", "input", "link", "rect", "line", "path", "circle"):
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        self.attributes += [(name, value or "") for name, value in attrs]

    def handle_endtag(self, tag):
        if tag in ("rect", "line", "path", "circle"):
            return
        if not self.open or self.open[-1] != tag:
            self.unbalanced.append(tag)
        else:
            self.open.pop()


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    """The pp_fsdp_tp recipe's page on the 8 test devices, analytic figures only (its compile takes ~20 s here)."""
    path = tmp_path_factory.mktemp("html") / "plan.html"
    assert main(["plan", "recipes/pp_fsdp_tp.toml", "--html", str(path), "--no-compile"]) == 0
    return path.read_text()


@pytest.fixture(scope="module")
def compiled_page(tmp_path_factory) -> str:
    """The fsdp_tp recipe's page with XLA:CPU's compiled figures beside the analytic ones."""
    path = tmp_path_factory.mktemp("html") / "plan.html"
    assert main(["plan", "recipes/fsdp_tp.toml", "--html", str(path)]) == 0
    return path.read_text()


def test_page_parses_and_has_every_part(page):
    parsed = _Collector()
    parsed.feed(page)
    assert not parsed.unbalanced and parsed.open == [], (parsed.unbalanced, parsed.open)
    assert parsed.tags.count("svg") == 4  # mesh, memory, communication, pipeline Gantt
    assert page.count('aria-label="mesh of devices"') == 1
    for coords in ("pp0 fs0 tp0", "pp1 fs1 tp1"):  # device cells labelled with their mesh coordinates
        assert coords in page
    assert ">analytic<" in page  # memory bars
    assert "over pipeline" in page and "over tensor" in page  # bytes per mesh axis and collective
    assert "stage 1" in page and "bubble" in page  # the Gantt chart


def test_compiled_page_has_compiled_bars_beside_analytic(compiled_page):
    parsed = _Collector()
    parsed.feed(compiled_page)
    assert not parsed.unbalanced and parsed.tags.count("svg") == 3  # no pipeline: no Gantt chart
    assert ">analytic<" in compiled_page and ">compiled<" in compiled_page
    assert "analytic vs compiled" in compiled_page and "http" not in compiled_page

def _assert_one_memory_total(page: str) -> None:
    """The analytic bar's total (the label after it) is the table's total."""
    bar = page[page.index('aria-label="memory per device"'):]
    bar_total = re.search(r">analytic<.*?<text [^>]*>([0-9.]+ [KMG]?i?B)</text>", bar[: bar.index("</svg>")]).group(1)
    table_total = re.search(r'<td class="">total</td><td class="num">([^<]+)</td>', page).group(1)
    assert bar_total == table_total, (bar_total, table_total)


def test_the_memory_bar_adds_up_to_the_tables_total(tmp_path, page):
    """The pipeline loop's terms (zero_bubble's and gpipe's) are drawn, so the bar and the table agree."""
    _assert_one_memory_total(page)
    path = tmp_path / "zero_bubble.html"
    assert main(["plan", "recipes/pp_fsdp_tp.toml", "--set", "pipeline.schedule=zero_bubble", "--html", str(path),
                 "--no-compile"]) == 0
    text = path.read_text()
    _assert_one_memory_total(text)
    assert "pipeline: stage_inputs" in text


def test_the_compiled_bar_adds_up_to_the_compiled_peak():
    """XLA's peak beyond its state and temporaries is drawn as `other`, so the bar's label is the table's peak."""
    compiled = [{"what": "state (params)", "compiled": 512 * 2**10},
                {"what": "step temporaries", "compiled": 5 * 2**20},
                {"what": "peak", "compiled": 512 * 2**10 + 5 * 2**20 + 16 * 2**10}]
    svg = memory_svg({"params": 2**20, "total": 2**20}, compiled, None)
    assert "other: 16.00 KiB" in svg and ">5.52 MiB<" in svg


def test_the_communication_chart_draws_stage_rows_and_marks_the_step_rows_they_complete():
    plan = {"compiled": {"communication": [
        {"what": "reduction over tensor", "analytic": 1.26 * 2**20, "compiled": 128 * 2**10, "in_branches": True},
        {"what": "all-gather over fsdp", "analytic": 2**18, "compiled": 2**18, "in_branches": False}],
        "stages": [[{"what": "reduction", "analytic": 3 * 2**20, "compiled": 4 * 2**20}],
                   [{"what": "reduction", "analytic": 3.5 * 2**20, "compiled": 5 * 2**20}]]}}
    rows, stages = communication_rows(plan), stage_rows(plan)
    assert [what for what, _, _ in rows] == ["reduction over tensor *", "all-gather over fsdp"]
    assert stages == [("stage 0: reduction", 3 * 2**20, 4 * 2**20), ("stage 1: reduction", 3.5 * 2**20, 5 * 2**20)]
    svg = html.unescape(communication_svg(rows, stages))
    assert STAGE_HEADING in svg and "compiled 5.00 MiB" in svg and svg.index("stage 0") > svg.index("over fsdp")


def test_page_fetches_nothing(page):
    parsed = _Collector()
    parsed.feed(page)
    assert "http" not in page.lower() and "//" not in page.replace("<!--", "")
    assert not {"script", "link", "img", "iframe"} & set(parsed.tags)
    assert not [value for name, value in parsed.attributes if name in ("src", "href")]


CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; Playwright's own browser download is not needed
# A pipeline (with its Gantt chart; zero_bubble's tick switches give per-stage communication rows) and an MoE layout,
# compiled figures in. The pipeline is compiled for h100x8 at m = p = 2 (its micro-batch as the recipe has it: a
# warm-up, a steady tick and a drain per stage, every row of the chart), test_pipeline_estimate's zero_bubble program:
# conftest's `SAME_WORKER` runs both modules in one process, which compiles it once (tests/compile_only_memo.py). The
# MoE page and `compiled_page` hold XLA:CPU's compiled figures.
BROWSER_RECIPES = {"pp_fsdp_tp": ("--set", "pipeline.schedule=zero_bubble", "--set", "pipeline.microbatches=2",
                                  "--set", "train.global_batch=8", "--target", "h100x8"), "moe_ep": ()}
NEEDS_PLUGIN = {"pp_fsdp_tp": pytest.mark.skipif(not cuda_plugin_available(),
                                                 reason="needs the jax[cuda12] plugin to compile for --target")}
PIXEL_TOLERANCE = 0.5  # sub-pixel rounding of text boxes
LABEL_BOXES = """() => Array.from(document.querySelectorAll('svg')).map(svg => {
  const frame = svg.getBoundingClientRect();
  const labels = Array.from(svg.querySelectorAll('text')).map(text => {
    const box = text.getBoundingClientRect();
    return {text: text.textContent, left: box.left - frame.left, top: box.top - frame.top,
            right: box.right - frame.left, bottom: box.bottom - frame.top};
  });
  const name = svg.getAttribute('aria-label') || 'pipeline schedule';
  return {name, width: frame.width, height: frame.height, labels};
})"""


@pytest.fixture(scope="module")
def chromium():
    if not CHROMIUM.is_file():
        if os.environ.get("SHARDKIT_REQUIRE_BROWSER") == "1":
            pytest.fail(f"no {CHROMIUM}: `make test` installs it (apt-get install -y chromium)")
        pytest.skip(f"no {CHROMIUM} (`make test` installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        yield browser
        browser.close()


@functools.cache
def _compiled_page(name: str) -> Path:
    """A recipe's page with its compiled figures (`BROWSER_RECIPES`' overrides), written once per session."""
    path = Path(tempfile.mkdtemp(prefix="shardkit-plan-html-")) / f"{name}.html"
    assert main(["plan", f"recipes/{name}.toml", *BROWSER_RECIPES[name], "--html", str(path)]) == 0
    return path


@pytest.fixture(scope="module", params=[pytest.param(name, marks=NEEDS_PLUGIN.get(name, ()))
                                        for name in BROWSER_RECIPES])
def browser_page(request) -> Path:
    return _compiled_page(request.param)


@pytest.mark.slow
@NEEDS_PLUGIN["pp_fsdp_tp"]
def test_a_zero_bubble_page_shows_per_stage_communication_in_the_chart_and_one_memory_total():
    """The step's reduction over tensor leaves out what runs in the tick switches (marked `*`); the chart itself holds
    each stage's attributed figures. The memory bar adds up to the table's total, pipeline loop terms included."""
    page = _compiled_page("pp_fsdp_tp").read_text()
    chart = page[page.index('aria-label="bytes per step per mesh axis and collective"'):]
    chart = chart[: chart.index("</svg>")]
    assert "reduction over tensor *" in chart and STAGE_HEADING in html.unescape(chart)
    for stage in (0, 1):
        assert f"stage {stage}: reduction" in chart and f"stage {stage}: all-gather" in chart
    _assert_one_memory_total(page)


def _overlap(a: dict, b: dict) -> bool:
    width = min(a["right"], b["right"]) - max(a["left"], b["left"])
    height = min(a["bottom"], b["bottom"]) - max(a["top"], b["top"])
    return width > PIXEL_TOLERANCE and height > PIXEL_TOLERANCE


def _outside(label: dict, svg: dict) -> bool:
    return (label["left"] < -PIXEL_TOLERANCE or label["top"] < -PIXEL_TOLERANCE
            or label["right"] > svg["width"] + PIXEL_TOLERANCE or label["bottom"] > svg["height"] + PIXEL_TOLERANCE)


@pytest.mark.slow
def test_page_in_chromium_has_no_errors_and_no_clipped_or_overlapping_labels(chromium, browser_page):
    tab = chromium.new_page()
    errors = []
    tab.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    tab.on("pageerror", lambda error: errors.append(str(error)))
    tab.goto(browser_page.as_uri())
    svgs = tab.evaluate(LABEL_BOXES)
    tab.close()
    assert errors == []
    assert len(svgs) == (4 if "pp" in browser_page.stem else 3)
    for svg in svgs:
        assert svg["labels"], svg["name"]
        clipped = [label["text"] for label in svg["labels"] if _outside(label, svg)]
        assert clipped == [], f"{svg['name']}: labels outside the {svg['width']:.0f} x {svg['height']:.0f} chart"
        labels = svg["labels"]
        overlapping = [(a["text"], b["text"]) for i, a in enumerate(labels) for b in labels[i + 1:] if _overlap(a, b)]
        assert overlapping == [], svg["name"]
