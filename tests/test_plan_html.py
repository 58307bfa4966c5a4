"""`plan --html`: one self-contained page (parses, has the SVG parts, fetches nothing); in a browser where one is
installed, it renders without console errors."""

from __future__ import annotations

import html.parser
import shutil

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


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    return None


def test_page_renders_without_console_errors_in_chromium(page, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    path = tmp_path / "plan.html"
    path.write_text(page)
    with playwright.sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=shutil.which(_browser()) if _browser() else None)
        except Exception as err:  # noqa: BLE001 - no browser downloaded / installed
            pytest.skip(f"no headless Chromium here: {str(err).splitlines()[0]}")
        errors = []
        tab = browser.new_page()
        tab.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        tab.on("pageerror", lambda error: errors.append(str(error)))
        tab.goto(path.as_uri())
        assert tab.locator("svg").count() == 4
        browser.close()
    assert errors == []
