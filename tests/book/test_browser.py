"""The built HTML book in a real browser: every page loads offline, whole, and its explorers work.

``_build/html`` (``make book``) is served by ``http.server`` on 127.0.0.1 and every page is
opened in headless Chromium (Debian's ``chromium``, driven by Python playwright). A page passes
when it loads, logs no console error and throws no JavaScript error, requests nothing from
another host, every ``<img>`` decoded (``naturalWidth > 0``), and it embeds no ipywidgets view
(a widget without a kernel is a control that does nothing). On pages with static explorers,
every option of every control is clicked: exactly one panel shows, it is the selected one, its
content differs from the previous one, and on the seed × mode explorer the verdict follows the
mode. A screenshot of each page (its first 1280 x 900 px; the whole page with
``TPATTN_FULL_SCREENSHOTS=1``) goes to ``_build/screenshots/``. At 1280 px wide, no
code block or cell output on any page scrolls sideways (``scrollWidth > clientWidth + 1``): code
and outputs fit the text column.

Skipped when ``_build/html`` does not exist (``make test`` builds it first). Without Chromium it
skips, except under CI (``CI=true``), where it fails. ``TPATTN_BUILD_DIR`` points it at another
build (default ``<repo>/_build``).
"""
from __future__ import annotations

import functools
import http.server
import os
import pathlib
import re
import shutil
import threading
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("TPATTN_BUILD_DIR", ROOT / "_build"))
HTML = BUILD / "html"
SCREENSHOTS = BUILD / "screenshots"
#: A whole-page screenshot costs 3-10 s of Chromium per page here (the first screen: 0.15 s).
FULL_SCREENSHOTS = os.environ.get("TPATTN_FULL_SCREENSHOTS", "") == "1"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
LOCAL_HOST = "127.0.0.1"

pytestmark = pytest.mark.built_book  # make test runs this module after building the book

#: Hosts other than 127.0.0.1 a page may request. None: the book serves MathJax itself, loads
#: no widget JavaScript, fonts or analytics from a CDN, and links (launch buttons, papers) are
#: only followed on click. Any request elsewhere would be a page that breaks offline; the test
#: aborts it (so nothing leaves the machine) and fails, naming it.
ALLOWED_EXTERNAL_HOSTS: frozenset[str] = frozenset()

#: Console errors that are not the book's, each with its reason. One: pydata-sphinx-theme
#: 0.15 (under sphinx-book-theme 1.1) logs this on a browser's very first page of the site,
#: when localStorage has no theme mode yet (its inline head script sets ``data-mode`` to "");
#: it then stores "auto" and never logs it again (upstream: pydata/pydata-sphinx-theme#1635).
#: Only the exact empty-mode message is allowed; any other theme mode error still fails.
KNOWN_CONSOLE_ERRORS = (re.compile(r"^Got invalid theme mode: \. Resetting to auto\. \("),)

#: Directories of the build that hold assets, not pages.
NOT_PAGES = {"_static", "_sources", "_images", "_downloads", ".doctrees", "_sphinx_design_static"}


def book_pages() -> list[str]:
    """Every HTML page of the build, relative to ``_build/html``, in a stable order."""
    if not HTML.is_dir():
        return []
    return sorted(str(p.relative_to(HTML)) for p in HTML.rglob("*.html")
                  if not NOT_PAGES & set(p.relative_to(HTML).parts[:-1]))


PAGES = book_pages()


def _is_redirect(page_path: str) -> bool:
    """A stub that only forwards (Jupyter Book's root ``index.html``): nothing to lay out, and
    evaluating on it races its own navigation."""
    return 'http-equiv="Refresh"' in (HTML / page_path).read_text(errors="replace")[:500]


@pytest.fixture(scope="module")
def server():
    """``_build/html`` over HTTP on 127.0.0.1, on a free port, in a thread."""
    handler = functools.partial(_QuietHandler, directory=str(HTML))
    httpd = http.server.ThreadingHTTPServer((LOCAL_HOST, 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOCAL_HOST}:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no access log on the test's stderr
        pass


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium; missing Chromium skips, or fails under CI."""
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        message = ("Debian's chromium is not installed (apt-get install chromium; "
                   ".ci/run installs it)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
            headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class PageLog:
    """What a page did while loading: console errors, JS errors, failed and external requests."""

    def __init__(self, page):
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.external: list[str] = []
        self.failed: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        page.on("requestfailed", lambda r: self.failed.append(f"{r.url}: {r.failure}"))
        page.route("**/*", self._route)

    def _console(self, message):
        if message.type != "error":
            return
        text = f"{message.text} ({message.location.get('url', '')})"
        if not any(known.match(text) for known in KNOWN_CONSOLE_ERRORS):
            self.console_errors.append(text)

    def _route(self, route):
        url = route.request.url
        host = urllib.parse.urlsplit(url).hostname
        if url.startswith(("data:", "blob:")) or host == LOCAL_HOST:
            route.continue_()
        else:
            if host not in ALLOWED_EXTERNAL_HOSTS:
                self.external.append(url)
            route.abort()


def _screenshot_name(page_path: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "__", page_path.removesuffix(".html")) + ".png"


@pytest.fixture(scope="module")
def context(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    yield context
    context.close()


#: The pages are dealt round robin into this many test classes: pytest-xdist
#: (``--dist loadscope``) hands a class to one worker whole, so that many workers open pages
#: at once, each with its own server and browser (module fixtures are per worker).
SHARDS = 2


@pytest.mark.skipif(not PAGES, reason=f"no built book at {HTML} (run `make book` first)")
class PagesInBrowser:
    """``test_page`` over this shard's ``pages``."""
    pages: list[str] = []

    def test_page(self, page_path, server, context):
        check_page(page_path, server, context)


class TestPages0(PagesInBrowser):
    pages = PAGES[0::SHARDS]


class TestPages1(PagesInBrowser):
    pages = PAGES[1::SHARDS]


def pytest_generate_tests(metafunc):
    if metafunc.cls is not None and issubclass(metafunc.cls, PagesInBrowser):
        metafunc.parametrize("page_path", metafunc.cls.pages or ["(none)"])


def test_every_page_is_in_exactly_one_shard():
    shards = [TestPages0.pages, TestPages1.pages]
    assert len(shards) == SHARDS and sorted(sum(shards, [])) == sorted(PAGES)


#: Code blocks and cell outputs of a page: what must fit the text column.
_BLOCKS = "div.highlight pre, div.cell_output pre, div.cell_output .output, .tpattn-source pre"

_OVERFLOWING = """sel => Array.from(document.querySelectorAll(sel))
    .filter(e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1)
    .map(e => ({width: e.scrollWidth, column: e.clientWidth,
                text: (e.innerText || '').split('\\n').sort((a, b) => b.length - a.length)[0]
                      .slice(0, 90)}))"""


def check_page(page_path, server, context):
    page = context.new_page()
    try:
        log = PageLog(page)
        response = page.goto(server + page_path, wait_until="load")
        assert response is not None and response.ok, f"{page_path}: HTTP {response and response.status}"
        page.wait_for_function("Array.from(document.images).every(i => i.complete)",
                               timeout=15_000)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / _screenshot_name(page_path)),
                        full_page=FULL_SCREENSHOTS)

        if not _is_redirect(page_path):
            overflowing = page.evaluate(_OVERFLOWING, _BLOCKS)
            assert not overflowing, (
                f"{page_path}: {len(overflowing)} code block(s)/output(s) scroll sideways at "
                f"1280 px: " + "; ".join(f"{o['width']} px in {o['column']} px: {o['text']!r}"
                                         for o in overflowing[:8]))
        broken = page.evaluate("""Array.from(document.images)
            .filter(i => i.naturalWidth === 0).map(i => i.src.slice(0, 100))""")
        assert not broken, f"{page_path}: images that did not load: {broken}"
        widget_views = page.locator('script[type="application/vnd.jupyter.widget-view+json"]')
        assert widget_views.count() == 0, (
            f"{page_path}: {widget_views.count()} ipywidgets view(s) in static HTML — a dead "
            f"control; the book's myst-nb config must give the widget view no priority")
        for explorer in page.locator(".tpx").all():
            check_static_explorer(page_path, explorer)

        assert not log.external, f"{page_path}: requests to other hosts: {log.external}"
        assert not log.page_errors, f"{page_path}: JavaScript errors: {log.page_errors}"
        assert not log.console_errors, f"{page_path}: console errors: {log.console_errors}"
        assert not log.failed, f"{page_path}: failed requests: {log.failed}"
    finally:
        page.close()


def _shown(explorer) -> dict:
    """The visible panel of a static explorer: its id, text and image sources (one round trip:
    the panel whose computed ``display`` is not ``none``)."""
    shown = explorer.evaluate("""ex => Array.from(ex.querySelectorAll('.tpx-panel'))
        .filter(p => getComputedStyle(p).display !== 'none')
        .map(p => ({id: p.id, text: p.innerText,
                    images: Array.from(p.querySelectorAll('img'))
                                 .map(i => ({src: i.src, width: i.naturalWidth}))}))""")
    assert len(shown) == 1, f"{len(shown)} panels visible, expected exactly 1"
    panel = shown[0]
    assert all(i["width"] > 0 for i in panel["images"]), "an image of the shown panel did not load"
    return {"id": panel["id"], "text": panel["text"],
            "images": tuple(i["src"] for i in panel["images"])}


def check_static_explorer(page_path: str, explorer) -> None:
    """Click every option of every control; the shown panel must follow, and change."""
    where = f"{page_path}, explorer {explorer.get_attribute('id')}"
    explorer.scroll_into_view_if_needed()
    assert explorer.locator(".tpx-controls").is_visible(), f"{where}: its controls are hidden"
    groups = explorer.locator(".tpx-group")
    selection = [int(i) for i in _shown(explorer)["id"].rsplit("-p", 1)[1].split("-")]
    before = _shown(explorer)
    for g in range(groups.count()):
        labels = groups.nth(g).locator("label")
        for i in [*range(labels.count()), selection[g]]:  # every option, then back
            labels.nth(i).click()
            changed = selection[g] != i
            selection[g] = i
            after = _shown(explorer)
            expected = "-p" + "-".join(map(str, selection))
            assert after["id"].endswith(expected), (
                f"{where}: clicked {labels.nth(i).inner_text()!r}, shows {after['id']}")
            if changed:
                assert (after["text"], after["images"]) != (before["text"], before["images"]), (
                    f"{where}: clicking {labels.nth(i).inner_text()!r} changed nothing shown")
            before = after
    if explorer.get_attribute("data-tpx-kind") == "seed-mode":
        check_seed_mode_verdicts(where, explorer)


def check_seed_mode_verdicts(where: str, explorer) -> None:
    """Equivalence passes and each missing reduction fails, for every seed shown."""
    seed_labels, mode_labels = (explorer.locator(".tpx-group").nth(k).locator("label")
                                for k in range(2))
    for s in range(seed_labels.count()):
        seed_labels.nth(s).click()
        for m in range(mode_labels.count()):
            mode = mode_labels.nth(m).inner_text().strip()
            mode_labels.nth(m).click()
            verdict = explorer.evaluate("""ex => Array.from(ex.querySelectorAll('.tpx-panel'))
                .filter(p => getComputedStyle(p).display !== 'none')
                .map(p => p.querySelector('.tpx-verdict').innerText.trim())""")
            assert len(verdict) == 1, f"{where}: {len(verdict)} panels visible"
            verdict = verdict[0]
            expected = "PASSED" if mode == "equivalence" else "FAILED"
            assert verdict == expected, (f"{where}: seed {seed_labels.nth(s).inner_text()}, "
                                         f"mode {mode} shows {verdict}, expected {expected}")
