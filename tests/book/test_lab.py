"""Every chapter in a real JupyterLab, as a reader runs it: open, Run All Cells, read the page.

One ``jupyter lab`` server (this interpreter's, on 127.0.0.1, a token, its own settings and
workspaces folders) serves a temporary copy of ``book/`` — running a notebook never touches the
committed files. Headless Chromium (Debian's ``chromium``, driven by Python playwright) opens each
chapter, picks Run > Run All Cells from the menu bar and waits until no cell shows ``[*]``. A
chapter passes when:

- every code cell ran (its prompt shows a number) and no output shows a traceback;
- no markdown cell shows a raw Sphinx directive (```` ```{ ````, ``:pyobject:``,
  ``{literalinclude}``, ``{eval-rst}``) — JupyterLab renders them as text;
- every shown source (``tpattn.source.show_source``: ``.tpattn-source``) is exactly
  ``inspect.getsource`` of the object its caption ``tpattn/x.py · name`` names;
- where the chapter has a live explorer, the first one responds to a click: its output changes.

Skipped without Chromium or playwright (failed under ``CI=true``). ``make test-lab`` runs it, and
``.ci/run`` runs ``make test-lab``; ``make test`` leaves it out (marker ``lab``): it is the
slowest test by far (every chapter a second time, in a browser) and only a frontend can break
it. ``make test`` keeps its cheap part: ``tests/book/test_source.py`` checks that no markdown cell
holds a raw directive.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import types
import urllib.request

import pytest

from tests.book.test_source import RAW_DIRECTIVES

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "book").glob("*.ipynb"))
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
TOKEN = "tpattn-lab-test"
#: Where each chapter's last view is saved (what the reader saw when the test ended).
SCREENSHOTS = ROOT / "_build" / "lab-screenshots"
#: Run > Run All Cells is tried this many times, each given this long to start the first cell:
#: a click that lands while the new kernel's session is still settling is dropped by
#: JupyterLab (every prompt stays ``[ ]``), and nothing has run, so trying again is safe.
RUN_ALL_TRIES = 3
RUN_ALL_START_S = 30
#: Longest a chapter may take to run all its cells here (the slowest, chapter 11, starts real
#: rank processes: ~30 s on 2 busy cores).
RUN_ALL_TIMEOUT_S = 300
#: JupyterLab user settings for the test: no autosave, every cell in the DOM (no windowing),
#: no news prompt.
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
}


pytestmark = pytest.mark.lab  # make test-lab (and CI) runs this module; make test does not


def _skip_or_fail(message: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, path: str, method: str = "GET"):
    request = urllib.request.Request(f"{base}{path}", method=method,
                                     headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
    return json.loads(body) if body else None


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a copy of book/; yields its base URL (``url``) and that copy
    (``book``), which the checks read (the committed files may change while it runs)."""
    if importlib.util.find_spec("jupyterlab") is None:
        _skip_or_fail("jupyterlab is not installed")
    tmp = tmp_path_factory.mktemp("lab")
    book = tmp / "book"
    shutil.copytree(ROOT / "book", book, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    settings = tmp / "settings"
    for name, values in SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    port = _free_port()
    log = open(tmp / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
         f"--port={port}", "--allow-root", f"--IdentityProvider.token={TOKEN}",
         f"--LabApp.workspaces_dir={tmp / 'workspaces'}", f"--ServerApp.root_dir={book}",
         "--ServerApp.open_browser=False"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                _api(base, "/api/status")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"jupyter lab did not start:\n{(tmp / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield types.SimpleNamespace(url=base, book=book)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        _skip_or_fail("Debian's chromium is not installed (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _skip_or_fail("playwright is not installed")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
            headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def _object_of(caption: str):
    """``tpattn/real/ranks.py · CopyToRanks`` → the object it names."""
    where, name = (part.strip() for part in caption.split("·"))
    module = importlib.import_module(where.removesuffix(".py").replace("/", "."))
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _wait_for_idle_kernel(base: str, name: str, timeout_s: float = 180) -> None:
    """Until the server reports the kernel of notebook ``name`` started and idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [s["kernel"]["execution_state"] for s in _api(base, "/api/sessions") or []
                  if s.get("path", "").endswith(name) and s.get("kernel")]
        if "idle" in states:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{name}: its kernel is not idle after {timeout_s:.0f} s: {states}")
        time.sleep(0.5)


_ANY_STARTED = """() => [...document.querySelectorAll(
    '.jp-Notebook .jp-CodeCell .jp-InputPrompt')].some(p => p.textContent.trim() !== '[ ]:')"""


def _run_all(page, name: str) -> None:
    """Run > Run All Cells from the menu bar, until a cell has started (``RUN_ALL_TRIES``)."""
    for attempt in range(1, RUN_ALL_TRIES + 1):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(_ANY_STARTED, timeout=RUN_ALL_START_S * 1000)
            return
        except Exception:  # noqa: BLE001 — playwright's TimeoutError: nothing started
            if attempt == RUN_ALL_TRIES:
                raise AssertionError(f"{name}: Run All Cells started no cell in "
                                     f"{RUN_ALL_TRIES} tries of {RUN_ALL_START_S} s") from None


def _shut_down_kernels(base: str) -> None:
    for session in _api(base, "/api/sessions") or []:
        _api(base, f"/api/sessions/{session['id']}", method="DELETE")


_ALL_RAN = """() => {
  const prompts = [...document.querySelectorAll(
      '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')]
      .map(p => p.textContent.trim());
  return prompts.length > 0 && !prompts.some(p => p.includes('*'))
      && prompts.some(p => /\\[\\d+\\]/.test(p));
}"""


#: The chapters are dealt round robin into this many test classes. pytest-xdist
#: (``--dist loadscope``) hands a class to one worker whole, so up to this many workers run
#: chapters at once, each with its own server and browser (module fixtures are per worker);
#: one class of all chapters kept one worker busy for minutes while the others idled. Two, for
#: the 2 workers of a 2-core machine: ``make test-lab`` runs this module alone, and with three
#: classes one worker ran two of them (12 chapters) while the other ran 6 and then waited.
SHARDS = 2


class ChaptersInLab:
    """``test_chapter_runs_in_jupyterlab`` over this shard's ``chapters``."""
    chapters: list[pathlib.Path] = []

    def test_chapter_runs_in_jupyterlab(self, chapter, lab, browser):
        run_chapter_in_lab(chapter, lab, browser)


class TestChapters0(ChaptersInLab):
    chapters = CHAPTERS[0::SHARDS]


class TestChapters1(ChaptersInLab):
    chapters = CHAPTERS[1::SHARDS]


def pytest_generate_tests(metafunc):
    if metafunc.cls is not None and issubclass(metafunc.cls, ChaptersInLab):
        metafunc.parametrize("chapter", metafunc.cls.chapters,
                             ids=[c.stem for c in metafunc.cls.chapters])


def test_every_chapter_is_in_exactly_one_shard():
    shards = [TestChapters0.chapters, TestChapters1.chapters]
    assert len(shards) == SHARDS and sorted(sum(shards, [])) == CHAPTERS


def run_chapter_in_lab(chapter, lab, browser):
    served = json.loads((lab.book / chapter.name).read_text())  # what the server serves
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    name = chapter.name
    try:
        page.goto(f"{lab.url}/lab/tree/{name}?reset&token={TOKEN}",
                  wait_until="domcontentloaded")
        notebook = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
        notebook.wait_for(timeout=120_000)
        n_code = sum(c["cell_type"] == "code" for c in served["cells"])
        page.wait_for_function(
            f"() => document.querySelectorAll('.jp-Notebook .jp-CodeCell').length >= {n_code}",
            timeout=120_000)
        # the kernel must be up before Run All
        page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(
            timeout=180_000)
        _wait_for_idle_kernel(lab.url, name)
        _run_all(page, name)
        page.wait_for_function(_ALL_RAN, timeout=RUN_ALL_TIMEOUT_S * 1000, polling=500)

        problems = []  # every check runs; the test reports all that failed
        prompts = page.eval_on_selector_all(".jp-Notebook .jp-CodeCell .jp-InputPrompt",
                                            "ps => ps.map(p => p.textContent.trim())")
        not_run = [i for i, p in enumerate(prompts) if not any(ch.isdigit() for ch in p)]
        outputs = page.eval_on_selector_all(".jp-Notebook .jp-OutputArea-output",
                                            "os => os.map(o => o.innerText)")
        tracebacks = [o[:300] for o in outputs if "Traceback" in o]
        if tracebacks:
            problems.append(f"outputs with a traceback: {tracebacks}")
        if len(prompts) != n_code or not_run:
            problems.append(f"code cells that did not run: {not_run} of {len(prompts)}")

        markdown = page.eval_on_selector_all(".jp-Notebook .jp-MarkdownCell",
                                             "cs => cs.map(c => c.innerText)")
        raw = [(i, d) for i, text in enumerate(markdown) for d in RAW_DIRECTIVES if d in text]
        if raw:
            problems.append(f"markdown cells that show a raw directive: {raw}")

        sources = page.eval_on_selector_all(
            ".jp-Notebook .tpattn-source",
            "bs => bs.map(b => ({caption: b.firstElementChild.textContent,"
            " code: b.querySelector('pre').textContent}))")
        expected = sum("show_source(" in "".join(c["source"])
                       for c in served["cells"]
                       if c["cell_type"] == "code")
        if len(sources) < expected:
            problems.append(f"{len(sources)} sources shown for {expected} show_source calls")
        for shown in sources:
            obj = _object_of(shown["caption"])
            if shown["code"].rstrip("\n") != inspect.getsource(obj).rstrip("\n"):
                problems.append(f"the code shown for {shown['caption']} is not its source")

        try:
            check_first_explorer(page, name)
        except (AssertionError, Exception) as error:  # noqa: BLE001 — reported with the rest
            problems.append(f"explorer: {type(error).__name__}: {str(error)[:300]}")
        assert not problems, f"{name}:\n" + "\n".join(problems)
    finally:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{chapter.stem}.png"))
        context.close()
        _shut_down_kernels(lab.url)


_OUTPUT_STATE = """o => o.innerText + '|' +
    [...o.querySelectorAll('img')].map(i => i.src.length + ':' + i.src.slice(-64)).join(',')"""


def check_first_explorer(page, name: str) -> None:
    """Change one control of the chapter's first live explorer; its output must change."""
    widgets = page.locator(".jp-Notebook .jp-OutputArea-output .widget-vbox")
    if widgets.count() == 0:
        return  # this chapter has no live explorer
    explorer = widgets.first
    explorer.scroll_into_view_if_needed()
    output = explorer.locator(".widget-output").first
    output.wait_for(timeout=30_000)
    before = output.evaluate(_OUTPUT_STATE)
    toggles = explorer.locator("button.widget-toggle-button:not(.mod-active)")
    selects = explorer.locator(".widget-dropdown select")
    numbers = explorer.locator(".widget-text input")
    if toggles.count():
        toggles.first.click()
    elif selects.count():
        select = selects.first
        # ipywidgets shows an option's spaces as no-break spaces; its value keeps the spaces
        options = select.locator("option").all_inner_texts()
        current = select.input_value()
        select.select_option(label=next(o for o in options
                                        if o.replace("\xa0", " ") != current))
    else:
        box = numbers.first
        box.fill(str(int(box.input_value()) * 2))
        box.press("Enter")
    page.wait_for_function(f"o => ({_OUTPUT_STATE})(o) !== {json.dumps(before)}",
                           arg=output.element_handle(), timeout=120_000)
    after = output.evaluate(_OUTPUT_STATE)
    assert after != before, f"{name}: the explorer did not respond to a click"
    assert "Traceback" not in after, f"{name}: the explorer shows a traceback"
