"""The dashboard in headless Chromium, against a real server under real traffic.

One server (a primary engine and a standby engine, both the demo model) samples its
history every 0.25 s instead of 2 s, so a minute's worth of samples takes seconds.
Two clients stream chat completions while Chromium shows /status; the primary's
engine is killed mid-traffic, so the timeline must show the failover and, once the
supervisor has restarted it, the failback. The page must draw every chart from the
live data, keep redrawing them, and log no console error.

Needs Chromium, chromedriver and selenium. Without them the test is skipped, with the
reason; with ``MLXSERVE_REQUIRE_BROWSER=1`` (CI) it fails instead.
``MLXSERVE_DOCS_SCREENSHOTS=1`` also writes the screenshot to docs/img/.
"""

import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.live import MODEL, REPO, LiveServer

pytestmark = pytest.mark.slow

REQUIRE = os.environ.get("MLXSERVE_REQUIRE_BROWSER") == "1"
SCREENSHOTS = REPO / "docs" / "img"
SAMPLE_S = 0.25
#: What "a minute of traffic" is at the default 2 s interval: 30 samples; ask for more.
SAMPLES_WITH_TRAFFIC = 40
WAIT_S = 180.0  # generous: a restart takes seconds alone, much longer on a loaded machine

CONFIG = """
model = "{model}"
[engine]
max_running = 2
prefill_step = 64
[server]
port = 0
ready_interval_s = 1.0
restart_backoff_s = 0.5
status_sample_s = {sample_s}
model_aliases = ["dsv4-demo"]
[policy]
overrides = ["nax_moe=full"]
[[fallback]]
name = "standby"
model = "{model}"
"""

CHARTS = (
    "chart-tokens",
    "chart-requests",
    "chart-ttft",
    "chart-itl",
    "chart-steps",
    "chart-memory",
    "chart-acceptance",
    "chart-depth",
    "chart-queue",
)


def _missing() -> str | None:
    """Why the browser test cannot run here (None: it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    if not _chromium():
        return "no chromium binary (apt-get install chromium)"
    if not shutil.which("chromedriver"):
        return "no chromedriver (apt-get install chromium-driver)"
    return None


def _chromium() -> str | None:
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    return next((path for path in map(shutil.which, names) if path), None)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = _missing()
    if reason is not None:
        if REQUIRE:
            pytest.fail(f"MLXSERVE_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = str(_chromium())
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1440,2400"):  # fmt: skip
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = CONFIG.format(model=MODEL, sample_s=SAMPLE_S)
    live = LiveServer(tmp_path_factory.mktemp("dashboard"), config)
    try:
        yield live.start()
    finally:
        assert live.stop() == 0, live.tail()


class Traffic:
    """Clients streaming chat completions until stopped; every answer must be a 200."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url = url
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> "Traffic":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _run(self, index: int) -> None:
        names = ("dsv4-demo", MODEL)  # the alias and the model setting both serve
        with httpx.Client(base_url=self.url, timeout=60) as client:
            sent = 0
            while not self.stop.is_set() and sent < 500:
                body = {
                    "model": names[(index + sent) % 2],
                    "messages": [{"role": "user", "content": f"Python reference {sent}: for"}],
                    "max_tokens": 24,
                    "stream": True,
                }
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    for _ in response.iter_lines():
                        pass
                    self.statuses.append(response.status_code)
                sent += 1


def _page(browser: Any, script: str) -> Any:
    return browser.execute_script(script)


def _points(browser: Any) -> dict[str, int]:
    return {
        chart: int(_page(browser, f"return document.getElementById('{chart}').dataset.points || 0"))
        for chart in CHARTS
    }


def _wait(what: str, check: Any, server: LiveServer | None = None) -> Any:
    deadline = time.monotonic() + WAIT_S
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            log = f":\n{server.tail()}" if server is not None else ""
            raise AssertionError(f"timed out waiting for {what}{log}")
        time.sleep(0.25)


def _samples(server: LiveServer) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = httpx.get(f"{server.url}/v1/status", timeout=10).json()[
        "history"
    ]["samples"]
    return samples


def test_startup_says_which_backends_are_up_and_counts_no_failback(server: LiveServer) -> None:
    ready = server.logged("ready: http://")
    assert "up: '" in ready and "OpenAI base URL" in ready
    if "not up yet" in ready:  # one engine was up first: the line must say which
        server.logged("is up (")
    assert server.metric("mlxserve_failbacks_total", to_backend="primary") == 0
    assert server.metric("mlxserve_failovers_total") == 0
    assert "reaches no rank" in server.logged("override nax_moe=full")
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [MODEL, "dsv4-demo"]


def test_the_dashboard_draws_live_charts_through_a_failover(
    server: LiveServer, browser: Any
) -> None:
    browser.get(f"{server.url}/status")
    assert browser.title.startswith("mlxserve:")
    _wait("the first poll", lambda: int(_page(browser, "return document.body.dataset.polls || 0")))
    with Traffic(server.url) as traffic:
        began = len(_samples(server))
        _wait("samples with traffic", lambda: len(_samples(server)) >= began + 12)
        before = _page(
            browser, "return document.querySelector('#chart-tokens path').getAttribute('d')"
        )
        _, detail = server.ready()
        primary = next(b for b in detail["backends"] if b["name"] == "primary")
        os.kill(primary["pid"], signal.SIGKILL)
        _wait("the failover on the timeline", lambda: _page(
            browser, "return document.querySelectorAll('#timeline circle.event-failover').length"
        ), server)  # fmt: skip
        _wait("the failback on the timeline", lambda: _page(
            browser, "return document.querySelectorAll('#timeline circle.event-failback').length"
        ), server)  # fmt: skip
        _wait(
            "a minute's worth of samples with traffic",
            lambda: len(_samples(server)) >= began + SAMPLES_WITH_TRAFFIC,
        )
    assert traffic.statuses and set(traffic.statuses) == {200}, traffic.statuses
    time.sleep(1.0)  # one more poll after the last request
    points = _points(browser)
    assert all(points.values()), points  # every chart drew live data
    after = _page(browser, "return document.querySelector('#chart-tokens path').getAttribute('d')")
    assert after != before  # redrawn as the history grew
    updates = int(_page(browser, "return document.getElementById('chart-tokens').dataset.updates"))
    assert updates >= 2
    incidents = _page(browser, "return document.querySelectorAll('#incidents tbody tr').length")
    assert incidents >= 1  # the kill, with its evidence
    status_text = _page(browser, "return document.getElementById('status').className")
    assert status_text == "ok"
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    shot = Path(server.config.parent) / "dashboard.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("MLXSERVE_DOCS_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOTS / "dashboard-failover.png")
