"""`plan --html`: one self-contained page (parses, has the SVG parts, fetches nothing), and in a real browser (Debian's
Chromium driven by Playwright) the pages of a pipeline recipe and an MoE recipe render without console errors, with
every SVG label inside its SVG and no two labels overlapping.

The browser test skips where /usr/bin/chromium is missing, except under `make test` (which installs it and sets
SHARDKIT_REQUIRE_BROWSER=1): there a missing browser fails."""

from __future__ import annotations

import html.parser
import os
from pathlib import Path

import pytest

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

def test_page_fetches_nothing(page):
    parsed = _Collector()
    parsed.feed(page)
    assert "http" not in page.lower() and "//" not in page.replace("<!--", "")
    assert not {"script", "link", "img", "iframe"} & set(parsed.tags)
    assert not [value for name, value in parsed.attributes if name in ("src", "href")]


CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; Playwright's own browser download is not needed
BROWSER_RECIPES = ("pp_fsdp_tp", "moe_ep")  # a pipeline (with its Gantt chart) and an MoE layout, compiled figures in
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


@pytest.fixture(scope="module", params=BROWSER_RECIPES)
def browser_page(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("browser") / f"{request.param}.html"
    assert main(["plan", f"recipes/{request.param}.toml", "--html", str(path)]) == 0
    return path


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
