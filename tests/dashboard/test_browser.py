"""The real dashboard server in a real Chromium: every page, visible content, screenshots."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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
    ("hit-rate", "hit_rate", "Token hit rate per time window"),
    ("evictions", "evictions", "Eviction attribution"),
    ("stale", "stale", "Drill-down"),
    ("latency", "latency", "Request waterfall"),
    ("compare", "compare", "Behaviours that differ"),
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


@pytest.fixture(scope="module")
def server(dashboard_db):
    port = free_port()
    SHOTS.mkdir(parents=True, exist_ok=True)
    with open(SHOTS.parent / "dashboard-server.log", "w") as log:
        proc = subprocess.Popen(dashboard_command(dashboard_db, port), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert proc.poll() is None, (SHOTS.parent / "dashboard-server.log").read_text()
            assert time.monotonic() < deadline, "dashboard did not serve within 90 s"
            time.sleep(0.3)
        yield url
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher and the Streamlit server it started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


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
    page.get_by_text(f"{s['stale_hashes']:,}", exact=True).first.wait_for(state="visible", timeout=30_000)
    body = page.inner_text("body")
    assert ui.ms(s["p99_ttft_ms"]) in body and f"{s['divergent_outputs']:,}" in body
    # Sidebar links carry the current filters to the next page.
    page.get_by_role("link", name="Hit rate").first.click()
    wait_rendered(page, "Token hit rate per time window")
    assert f"run={run_off}" in page.url and "/hit-rate" in page.url
