"""The HTML report and TensorBoard as a reader sees them (issues #32 and #38, point 5): a real
monitor run with many queries rendered by ``privmon report`` and opened in headless Chromium at
1280×900. The page does not scroll sideways although its "All checks" table is wider than the
column (that table scrolls inside its ``.scroll`` block instead, and without the block the same
page overflows), the 12-column table of the last check shows every column without scrolling,
every plot loads, every term a reader can hover carries its explanation and leads to its
glossary entry, and a full-page screenshot is a picture of the page. A small run with a budget
served by a real ``tensorboard`` on localhost (bounded in time, stopped by its pid): its Custom
Scalars page loads, and its first chart draws the named series, each from a run of its own in a
colour of its own.

Needs Playwright (the ``test`` extra) and a Chromium binary: the Debian
``chromium-headless-shell`` or ``chromium`` package (CI installs the first), or a browser of
Playwright's own; skipped, with the reason, when either is missing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privmon import PrivacyEarlyStopping, PrivacyMonitor
from privmon.cli import main
from privmon.queries import CallableQuery, LossQuery
from privmon.report import REPORT_NAME, tags
from privmon.report.blocks import GLOSSARY
from privmon.sinks import JsonlSink

pytestmark = pytest.mark.usefixtures("one_torch_thread")
WIDTH, HEIGHT = 1280, 900
N_QUERIES, STEPS, EVERY = 6, 12, 4  # 6 queries × 2 methods: 12 columns in "All checks"
BINARIES = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
PNG = b"\x89PNG\r\n\x1a\n"


def _chromium(playwright) -> str | None:
    """A Chromium binary on PATH (Debian's), else one Playwright installed itself."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    own = playwright.chromium.executable_path
    return own if own and os.path.exists(own) else None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (the test extra)"
    )
    with sync_api.sync_playwright() as playwright:
        path = _chromium(playwright)
        if path is None:
            pytest.skip(
                f"no Chromium binary: none of {', '.join(BINARIES)} on PATH and no browser of "
                "Playwright's own (apt-get install chromium-headless-shell)"
            )
        browser = playwright.chromium.launch(executable_path=path)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """``privmon report`` of a real run: a linear model trained 12 steps on its 64 members,
    checked every 4 steps by 6 loss queries with long names (one column each per method in the
    "All checks" table, too many for the page's 1200 px column)."""
    pytest.importorskip("matplotlib")
    logdir = tmp_path_factory.mktemp("browser")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=generator)
    y = torch.randint(0, 4, (128,), generator=generator)
    members, nonmembers = (x[:64], y[:64]), (x[64:], y[64:])
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    monitor = PrivacyMonitor(
        [LossQuery(model, name=f"cross_entropy_loss_of_head_{i}") for i in range(N_QUERIES)],
        [members],
        [nonmembers],
        every_n_steps=EVERY,
        planned_checks=STEPS // EVERY,
        sinks=[JsonlSink(logdir / "checks.jsonl")],
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        F.cross_entropy(model(members[0]), members[1]).backward()
        optimizer.step()
        monitor.step(step)
    monitor.close()
    assert main(["report", str(logdir)]) == 0
    return logdir / REPORT_NAME


def _open(browser, path):
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    return page


def _all_checks_scroll(page):
    """scrollWidth and clientWidth of the block holding the "All checks" table."""
    return page.evaluate(
        """() => {
        const h = [...document.querySelectorAll('h2')].find(e => e.textContent === 'All checks');
        const block = h.nextElementSibling;
        return {cls: block.className, scroll: block.scrollWidth, client: block.clientWidth,
                table: block.querySelector('table').scrollWidth};
    }"""
    )


def test_the_page_fits_1280_px_and_its_wide_table_scrolls_inside_its_column(
    browser, report, tmp_path
):
    page = _open(browser, report)
    # the document does not scroll sideways
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
    # the wide table does: its block scrolls, the table wider than the block
    block = _all_checks_scroll(page)
    assert block["cls"] == "scroll"
    assert block["scroll"] > block["client"] and block["table"] > block["client"], block
    assert block["client"] <= 1200  # inside the page's column (body max-width)
    page.evaluate(
        """() => {const h = [...document.querySelectorAll('h2')].find(
                      e => e.textContent === 'All checks');
                  h.nextElementSibling.scrollLeft = 10000;}"""
    )
    assert page.evaluate("window.scrollX") == 0  # scrolling the table leaves the page put
    # every plot loaded and fits the column: advantage, ROC, per-record risk per query
    images = page.evaluate(
        """() => [...document.images].map(i => ({alt: i.alt, complete: i.complete,
                  natural: i.naturalWidth, right: i.getBoundingClientRect().right}))"""
    )
    assert len(images) == 3 * N_QUERIES
    for image in images:
        assert image["complete"] and image["natural"] > 0, image
        assert image["right"] <= WIDTH, image
    # a full-page screenshot: the page's width, longer than the window, not blank
    shot = tmp_path / "report.png"
    page.screenshot(path=str(shot), full_page=True)
    page.close()
    data = shot.read_bytes()
    assert data.startswith(PNG)
    from PIL import Image  # matplotlib's dependency

    with Image.open(shot) as picture:
        width, height = picture.size
        colours = picture.convert("RGB").getcolors(maxcolors=1 << 20)
    assert width == WIDTH and height > HEIGHT
    assert colours is not None and len(colours) > 100  # text, tables and plots, not one colour
    white = max(count for count, rgb in colours if rgb == (255, 255, 255))
    assert white < 0.95 * width * height


def test_without_its_scroll_block_the_same_table_overflows_the_page(browser, report, tmp_path):
    """The check above can fail: the page of before the fix, its tables not wrapped, scrolls
    the whole document sideways at 1280 px."""
    unwrapped = tmp_path / "unwrapped.html"
    text = report.read_text(encoding="utf-8")
    assert text.count('<div class="scroll"><table>') > 0
    text = text.replace('<div class="scroll"><table>', "<table>").replace(
        "</table></div>", "</table>"
    )
    unwrapped.write_text(text, encoding="utf-8")
    page = _open(browser, unwrapped)
    assert page.evaluate("document.documentElement.scrollWidth") > WIDTH
    page.close()


def test_every_term_a_reader_hovers_explains_itself_and_leads_to_the_glossary(browser, report):
    page = _open(browser, report)
    terms = page.evaluate(
        """() => [...document.querySelectorAll('a.term, th[title]')].map(e => {
            const box = e.getBoundingClientRect();
            const href = e.getAttribute('href');
            const target = href ? document.querySelector(href) : null;
            return {tag: e.tagName, text: e.textContent, title: e.getAttribute('title'),
                    visible: box.width > 0 && box.height > 0, href: href,
                    target: target ? target.tagName + ':' + target.textContent : null};
        })"""
    )
    links = [t for t in terms if t["tag"] == "A"]
    headers = [t for t in terms if t["tag"] == "TH"]
    seen = {t["text"] for t in terms}
    for term in ("plug-in + McDiarmid", "W_N / U_N", "|f_p|", "MACE eq. 8", "certified lower"):
        assert term in seen, term
    for t in terms:
        assert t["visible"], t
        assert t["title"] == GLOSSARY[t["text"]], t  # the tooltip on hover
    for t in links:
        assert t["target"] == f"DT:{t['text']}", t  # its glossary entry
    assert {"AUC", "TPR@FPR=1%", "detectable", "plug-in + McDiarmid"} <= {
        t["text"] for t in headers
    }
    glossary = page.evaluate(
        "[...document.querySelectorAll('dl.glossary dt')].map(e => e.textContent)"
    )
    assert set(glossary) == seen  # every term on the page is listed, and only those
    # following a term's link brings its entry into view
    first = page.locator("a.term").first
    target = first.get_attribute("href")
    first.click()
    top = page.evaluate(f"document.querySelector('{target}').getBoundingClientRect().top")
    assert 0 <= top < HEIGHT
    page.close()


def test_the_last_checks_table_shows_every_column_at_1280_px(browser, report):
    # issue #38: its 12th column, "detectable", was cut off until one scrolled the table
    page = _open(browser, report)
    table = page.evaluate(
        """() => {
        const h = [...document.querySelectorAll('h2')].find(
            e => e.textContent.startsWith('At the last check'));
        const block = h.nextElementSibling, box = block.getBoundingClientRect();
        const heads = [...block.querySelectorAll('th')];
        return {scroll: block.scrollWidth, client: block.clientWidth, right: box.right,
                heads: heads.map(th => [th.textContent, th.getBoundingClientRect().right])};
    }"""
    )
    page.close()
    assert len(table["heads"]) == 12 and table["heads"][-1][0] == "detectable"
    assert table["scroll"] <= table["client"], table  # nothing to scroll to
    assert all(right <= table["right"] + 0.5 for _, right in table["heads"]), table
    assert table["right"] <= WIDTH


# --- TensorBoard ----------------------------------------------------------------------------------
def _tensorboard_run(logdir):
    """A small run with a budget: a leaking score, 3 checks, TensorBoard's event files."""
    g = torch.Generator().manual_seed(0)
    members, nonmembers = torch.randn(200, generator=g) + 1.0, torch.randn(200, generator=g)
    monitor = PrivacyMonitor(
        CallableQuery(lambda b: b, name="score"),
        [members],
        [nonmembers],
        every_n_steps=1,
        methods=("histogram",),
        planned_checks=3,
        writer=str(logdir),
        early_stopping=PrivacyEarlyStopping("score/histogram", 0.9, patience=1),
    )
    for step in (1, 2, 3):
        monitor.step(step)
    monitor.close()


@pytest.fixture(scope="module")
def tensorboard_url(tmp_path_factory):
    """``tensorboard --logdir`` of a small run on a free localhost port; the process is
    stopped, by its pid, when the tests are done (or if it never answers within 90 s)."""
    pytest.importorskip("tensorboard.main", reason="tensorboard's executable module is missing")
    logdir = tmp_path_factory.mktemp("tensorboard")
    _tensorboard_run(logdir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(logdir.parent / "tensorboard.log", "w")  # closed below
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--host", "127.0.0.1"], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tensorboard exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as r:
                    if len(json.load(r)) >= 4:  # the run and its named series
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("tensorboard did not list the runs within 90 s")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        log.close()


def test_tensorboards_first_custom_scalars_chart_draws_the_named_series(browser, tensorboard_url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{tensorboard_url}/#custom_scalars")
    card = page.locator("tf-custom-scalar-margin-chart-card").first
    card.wait_for(timeout=60_000)
    # the card's series, once loaded ('<tag> (<run>)'), and the colour TensorBoard gives each
    deadline = time.monotonic() + 60
    while card.evaluate("c => c._seriesNames.length") < 3 and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    drawn = card.evaluate(
        """c => ({title: c.title, top: c.getBoundingClientRect().top,
                  series: c._seriesNames.map(n => [n, c._colorScale.scale(n)])})"""
    )
    page.close()
    tag = tags.glance_advantage("score", "histogram")
    names = {name.removeprefix(f"{tag} (").removesuffix(")") for name, _ in drawn["series"]}
    assert names == {tags.SERIES_ESTIMATE, tags.SERIES_LOWER, tags.SERIES_THRESHOLD}
    assert len({colour for _, colour in drawn["series"]}) == 3  # one colour a series
    assert drawn["title"] == (
        "score (histogram): advantage estimate, certified lower bound and stopping threshold; "
        "shaded: advantages not ruled out"
    )
    assert 0 <= drawn["top"] < 1000  # on the first screen
