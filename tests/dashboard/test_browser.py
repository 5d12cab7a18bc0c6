"""The real dashboard server in a real Chromium: every page, visible content, screenshots."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from kvtrace.dashboard import ui
from kvtrace.store import read

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "test-artifacts" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# (url path, file stem, text that must be visible once the page has rendered)
PAGES = [
    ("", "overview", "Runs"),  # the default page lives at the root URL
    ("hit-rate", "hit_rate", "prefix cache hit rate (prefix_cache_hits"),
    ("evictions", "evictions", "Eviction attribution"),
    ("stale", "stale", "Drill-down"),
    ("latency", "latency", "Request waterfall"),
    ("compare", "compare", "Settings that differ"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_command(db: str, port: int) -> list[str]:
    """``kvtrace dashboard`` once the CLI has it; the same launch() via ``-m`` until then."""
    cli = shutil.which("kvtrace", path=str(Path(sys.executable).parent))
    if cli and subprocess.run([cli, "dashboard", "--help"], capture_output=True, timeout=60,
                              check=False).returncode == 0:
        return [cli, "dashboard", "--db", db, "--port", str(port)]
    return [sys.executable, "-m", "kvtrace.dashboard", "--db", db, "--port", str(port)]


@contextlib.contextmanager
def serving(db: str, log_name: str = "dashboard-server.log") -> Iterator[str]:
    """The dashboard served on ``db`` until the block ends: its base URL."""
    port = free_port()
    SHOTS.mkdir(parents=True, exist_ok=True)
    with open(SHOTS.parent / log_name, "w") as log:
        proc = subprocess.Popen(dashboard_command(db, port), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        try:
            while True:
                try:
                    if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                        break
                except OSError:
                    pass
                assert proc.poll() is None, (SHOTS.parent / log_name).read_text()
                assert time.monotonic() < deadline, "dashboard did not serve within 90 s"
                time.sleep(0.3)
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher and the Streamlit server it started
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(dashboard_db):
    with serving(dashboard_db) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run `make browser` (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def runs_on_off(db: str) -> tuple[str, str]:
    runs = sorted(((len(read.run(db, r)["behaviours"] or []), r) for r in read.runs(db)["run_id"]), reverse=True)
    return runs[0][1], runs[-1][1]


def wait_rendered(page, text: str) -> None:
    page.get_by_text(text, exact=False).first.wait_for(state="visible", timeout=60_000)
    # Let Streamlit finish the run (plotly draws after the element arrives).
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
    page.wait_for_timeout(800)


def screenshot(page, path: Path) -> None:
    """The whole page: Streamlit scrolls inside its main section, so grow the viewport to fit it."""
    height = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]')?.scrollHeight || 1000")
    page.set_viewport_size({"width": 1440, "height": min(int(height) + 40, 12000)})
    page.wait_for_timeout(1000)  # plotly re-lays out on resize
    page.screenshot(path=str(path))
    page.set_viewport_size({"width": 1440, "height": 1000})


def test_every_page_in_chromium(server, browser, dashboard_db):
    run_on, run_off = runs_on_off(dashboard_db)
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    SHOTS.mkdir(parents=True, exist_ok=True)
    for path, stem, text in PAGES:
        run = run_off if path == "stale" else run_on
        query = f"run={run}" + (f"&b={run_off}" if path == "compare" else "")
        page.goto(f"{server}/{path}?{query}")
        wait_rendered(page, text)
        if path == "stale" and read.stale_hashes_over_time(dashboard_db, run).height == 0:
            page.get_by_text("the cache stayed correct").first.wait_for(state="visible", timeout=60_000)
        elif path:
            page.locator(".js-plotly-plot").first.wait_for(state="visible", timeout=60_000)
        body = page.inner_text("body")
        assert "Traceback" not in body and "Page not found" not in body, stem
        screenshot(page, SHOTS / f"{stem}.png")
        assert (SHOTS / f"{stem}.png").stat().st_size > 10_000
    assert not errors, errors


def test_overview_shows_the_summary_and_links_keep_the_filters(server, browser, dashboard_db):
    _, run_off = runs_on_off(dashboard_db)
    s = read.run(dashboard_db, run_off)["summary"]
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(f"{server}/?run={run_off}")
    wait_rendered(page, "Divergent outputs")
    # The values themselves, as the summary says (waiting on them: the page streams in).
    page.get_by_text(ui.pct(s["prefix_cache_hit_rate"]), exact=True).first.wait_for(state="visible", timeout=30_000)
    assert "Prefix cache hit rate" in page.inner_text("body")
    page.get_by_text(f"{s['stale_hashes']:,}", exact=True).first.wait_for(state="visible", timeout=30_000)
    body = page.inner_text("body")
    assert ui.ms(s["p99_ttft_ms"]) in body and f"{s['divergent_outputs']:,}" in body
    # Sidebar links carry the current filters to the next page.
    page.get_by_role("link", name="Hit rate").first.click()
    wait_rendered(page, "prefix cache hit rate (prefix_cache_hits")
    assert f"run={run_off}" in page.url and "/hit-rate" in page.url


def plots(page) -> list[dict]:
    """Every plotly figure on the page as the browser laid it out: title, traces (name,
    visible), axis types and ranges, and the boxes of its title and subplot titles."""
    return page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].map(el => {
        const box = n => { const r = n.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
        return {
            title: ((el._fullLayout.title || {}).text || '').replace(/<[^>]+>/g, ''),
            traces: el._fullData.map(t => ({name: t.name, visible: t.visible, type: t.type})),
            xtype: el._fullLayout.xaxis ? el._fullLayout.xaxis.type : null,
            yrange: el._fullLayout.yaxis ? el._fullLayout.yaxis.range : null,
            titles: [...el.querySelectorAll('.gtitle, .annotation-text')].map(box),
            sankey: !!el.querySelector('.sankey'),
            texts: [...el.querySelectorAll('text')].map(n => n.textContent),
        };
    })""")


def wait_plot(page, title: str) -> None:
    """Until a laid-out plotly figure with this title is on the page."""
    page.wait_for_function("""t => [...document.querySelectorAll('.js-plotly-plot')]
        .some(el => el._fullLayout && ((el._fullLayout.title || {}).text || '').replace(/<[^>]+>/g, '') === t)""",
                           arg=title,
                           timeout=60_000)


def test_hit_rate_page_draws_the_request_hit_rate_on_its_own_chart_fitted_to_it(server, browser, dashboard_db):
    run_on, _ = runs_on_off(dashboard_db)
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(f"{server}/hit-rate?run={run_on}")
    wait_rendered(page, "prefix cache hit rate (prefix_cache_hits")
    wait_plot(page, "Prefix cache hit rate over time")
    wait_plot(page, "Group hit rates (each KV group alone; not the request hit rate)")
    figs = plots(page)
    main = next(f for f in figs if f["title"] == "Prefix cache hit rate over time")
    names = {t["name"] for t in main["traces"] if t["visible"] is True}
    assert {"prefix cache hit rate (per window)", "prefix cache hit rate (cumulative)"} <= names
    assert not any("group" in n for n in names)  # no group line drawn over it
    lo, hi = main["yrange"]
    assert lo > 0 or hi < 1  # fitted to the data, not 0..100%
    groups = next(f for f in figs if f["title"].startswith("Group hit rates"))
    assert any("attention group hit rate" in t["name"] for t in groups["traces"])


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def test_evictions_page_names_prefixes_and_keeps_titles_apart(server, browser, dashboard_db):
    _, run_off = runs_on_off(dashboard_db)
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(f"{server}/evictions?run={run_off}")
    wait_rendered(page, "Eviction attribution")
    page.locator(".js-plotly-plot").first.wait_for(state="visible", timeout=60_000)
    page.wait_for_timeout(1500)
    for fig in plots(page):
        boxes = [b for b in fig["titles"] if b[2] > b[0]]
        assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), fig["title"]
    texts = [t for f in plots(page) for t in f["texts"]]
    assert any(t in texts for t in ("LRU eviction", "key replaced", "stale hash evicted"))  # reasons in words
    for f in plots(page):
        if f["sankey"]:  # prefixes by short hash, first request and length, never a 64-hex hash
            assert any(" · first " in t for t in f["texts"])
            assert not any(len(t) >= 32 and all(c in "0123456789abcdef" for c in t) for t in f["texts"])


def test_latency_log_scale_and_compare_markdown_in_the_browser(server, browser, dashboard_db):
    run_on, run_off = runs_on_off(dashboard_db)
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(f"{server}/latency?run={run_on}&log=1")
    wait_rendered(page, "Request waterfall")
    wait_plot(page, "ITL and TPOT CDF")
    cdfs = [f for f in plots(page) if "CDF" in f["title"]]
    assert cdfs and all(f["xtype"] == "log" for f in cdfs)
    assert "modelled" in page.inner_text("body")
    # Compare: the default B, pp deltas, and the Markdown block
    page.goto(f"{server}/compare?run={run_on}")
    wait_rendered(page, "Settings that differ")
    assert f"b={run_off}" in page.url
    # the hit-rate tile's change, in percentage points (the page streams in: wait for it)
    page.get_by_text(re.compile(r"^[+-]\d+\.\d+ pp$")).first.wait_for(state="visible", timeout=60_000)
    assert "Not an isolated measurement" not in page.inner_text("body")
    page.get_by_text("Copy as Markdown").first.click()
    page.get_by_text("### kvtrace diff:").first.wait_for(state="visible", timeout=30_000)


def test_a_link_to_an_unknown_run_shows_a_warning_naming_it(server, browser):
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(f"{server}/?run=no-such-run")
    wait_rendered(page, "Run not found")
    body = page.inner_text("body")
    assert "no-such-run" in body and "Prefix cache hit rate" not in body


def test_names_are_drawn_as_typed_not_as_streamlits_logo_icons_emoji_or_arrows(browser, tmp_path):
    """Streamlit's markdown rewrites the parsed text, escaped or not (':streamlit:', ':material_x:',
    ':smile:' beside a code span's shortcode, ' -> '): AppTest cannot see it, a browser does."""
    from test_hostile import PLUGINS, plugin_store

    db = plugin_store(str(tmp_path / "plugins.duckdb"))
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    with serving(db, "dashboard-plugins-server.log") as url:
        for path, text in ((f"/?run={quote(f'id {PLUGINS}')}", "behaviours on"),
                           (f"/?run={quote(f'gone {PLUGINS}')}", "Run not found")):
            page.goto(url + path)
            wait_rendered(page, text)
            drawn = page.evaluate("""() => {
                const main = document.querySelector('[data-testid="stMain"]');
                return {text: main.innerText,
                        logos: main.querySelectorAll('img[alt="Streamlit logo"]').length,
                        icons: main.querySelectorAll('[data-testid="stMarkdownContainer"] span[role="img"]').length};
            }""")
            assert drawn["logos"] == 0 and drawn["icons"] == 0, drawn
            assert not re.search("[\U0001F604\u2192\u2190\u2194\u2014\u2265\u2264]", drawn["text"]), drawn["text"]
            assert PLUGINS in drawn["text"].replace("\u2060", ""), drawn["text"]
