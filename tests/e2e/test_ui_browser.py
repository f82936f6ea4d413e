"""The status page in a real browser: headless Chromium (Debian's `chromium`
and `chromium-driver`, driven by Selenium) opens `GET /ui` on a running Edge.

The page loads with no console errors, shows the node and its provider,
follows the node going away (its process stopped) and coming back (started
again) within a few seconds, shows an operator drain of its provider as a
badge until it is undrained, and shows a request count that grows while
requests run. A screenshot is saved to target/e2e-artifacts/ui.png. With
client keys the page asks for a key, shows why a key without the admin
scope is refused, and keeps an admin key in the tab's sessionStorage.

scripts/e2e.sh installs chromium when it runs as root with apt; elsewhere,
without the browser, this test skips and says why (CI=true: it fails).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from iop_harness import Cluster, post_raw, wait_until

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "target" / "e2e-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MODEL = "iop-test-model"
# The page updates once a second; allow a loaded machine a few more.
SEEN_WITHIN_S = 10.0


def _browser_or_skip():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package (tests/e2e/requirements.txt)")
    if missing:
        message = ("headless Chromium is not installed: missing " + ", ".join(missing)
                   + " (scripts/e2e.sh installs chromium and chromium-driver as root with apt)")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def browser():
    _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="iop-ui-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _text(driver, css: str) -> str:
    from selenium.webdriver.common.by import By

    elements = driver.find_elements(By.CSS_SELECTOR, css)
    return elements[0].text if elements else ""


def _node_phase(driver, node_id: str) -> str:
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.CSS_SELECTOR, f'tr[data-node="{node_id}"]')
    return rows[0].get_attribute("data-phase") if rows else ""


def _requests_total(driver) -> int:
    text = _text(driver, "#requests-total")
    return int(text) if text.isdigit() else -1


def _console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_the_status_page_in_headless_chromium(browser):
    with Cluster(mock_args=["--tokens", "3"]) as c:
        started = time.monotonic()
        browser.get(c.base_url + "/ui")
        assert browser.title == "IOP Edge status"
        wait_until(lambda: _text(browser, "#conn") == "live", timeout_s=SEEN_WITHIN_S, what="the page live")
        wait_until(lambda: _node_phase(browser, "node-a") == "ready", timeout_s=SEEN_WITHIN_S,
                   what="node-a shown connected")
        provider = _text(browser, 'tr[data-provider="node-a/mock-1"]')
        assert "mock-1" in provider and "mock-model" in provider and "available" in provider, provider
        assert "0 / 64" in provider, provider
        # The Edge's own logs: the access log on stderr, writing fine.
        access_log = _text(browser, 'tr[data-log="access log"]')
        assert "stderr" in access_log and "ok" in access_log, access_log
        # The model's routing policy (the harness routes by load).
        model = _text(browser, f'tr[data-model="{MODEL}"]')
        assert "least_loaded · 0 by load" in model, model
        # The configured node that never connects.
        assert _node_phase(browser, "node-offline") == "offline"
        assert "never connected" in _text(browser, 'tr[data-node="node-offline"]')

        # The node goes away, and comes back.
        c.nodes["node-a"].stop()
        wait_until(lambda: _node_phase(browser, "node-a") == "offline", timeout_s=SEEN_WITHIN_S,
                   what="node-a shown offline")
        assert "offline" in _text(browser, 'tr[data-provider="node-a/mock-1"]')
        c.start_node("node-a")
        wait_until(lambda: _node_phase(browser, "node-a") == "ready", timeout_s=SEEN_WITHIN_S,
                   what="node-a shown connected again")

        # An operator drain shows as a badge on the provider's row, and goes
        # with the undrain.
        row = 'tr[data-provider="node-a/mock-1"]'
        status, _, answer = post_raw(c.base_url + "/admin/providers/node-a/mock-1/drain", {})
        assert (status, json.loads(answer)) == (200, {"provider": "node-a/mock-1", "drained": True})
        wait_until(lambda: "drained" in _text(browser, row).split(), timeout_s=SEEN_WITHIN_S,
                   what="the drained badge shown")
        status, _, answer = post_raw(c.base_url + "/admin/providers/node-a/mock-1/undrain", {})
        assert (status, json.loads(answer)) == (200, {"provider": "node-a/mock-1", "drained": False})
        wait_until(lambda: "drained" not in _text(browser, row).split(), timeout_s=SEEN_WITHIN_S,
                   what="the drained badge gone")

        # Requests run: the count on the page grows.
        before = _requests_total(browser)
        assert before >= 0, _text(browser, "#requests-total")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        sent = 0
        deadline = time.monotonic() + SEEN_WITHIN_S
        while _requests_total(browser) < before + 5 and time.monotonic() < deadline:
            status, _, _ = post_raw(c.base_url + "/v1/chat/completions", body)
            assert status == 200
            sent += 1
            time.sleep(0.05)
        assert _requests_total(browser) >= before + 5, (before, sent, _text(browser, "#requests-total"))
        wait_until(lambda: _text(browser, "#ttft-p50").startswith("p50"), timeout_s=SEEN_WITHIN_S,
                   what="time to first token shown")

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACTS / "ui.png"))
        assert _console_errors(browser) == []
        assert time.monotonic() - started < 60, "the browser test should take seconds"


ADMIN_KEY = "sk-e2e-ui-admin-6f2d90b1c4e7a358"
USER_KEY = "sk-e2e-ui-user-0c7e51a9d3b2f846"


def test_the_page_asks_for_an_admin_key_and_keeps_it_for_the_tab(browser):
    from selenium.webdriver.common.by import By

    keys = {"ops": {"key": ADMIN_KEY, "scopes": ["admin"]}, "app": USER_KEY}
    with Cluster(client_keys=keys) as c:
        browser.get(c.base_url + "/ui")
        form = browser.find_element(By.ID, "key-form")
        wait_until(form.is_displayed, timeout_s=SEEN_WITHIN_S, what="the key form")
        assert _text(browser, "#conn") == "key needed"
        # A key without the admin scope is refused with the Edge's reason.
        browser.find_element(By.ID, "key").send_keys(USER_KEY)
        form.submit()
        refusal = ('this API key may not use /ui/events: give it scopes = ["admin"] in '
                   '[[client_keys]]')
        wait_until(lambda: _text(browser, "#key-reason") == refusal, timeout_s=SEEN_WITHIN_S,
                   what="the scope refusal shown")
        assert browser.execute_script("return sessionStorage.getItem('iop-edge-ui-key')") is None
        browser.find_element(By.ID, "key").send_keys(ADMIN_KEY)
        form.submit()
        wait_until(lambda: _node_phase(browser, "node-a") == "ready", timeout_s=SEEN_WITHIN_S,
                   what="node-a shown with the admin key")
        assert not form.is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('iop-edge-ui-key')") == ADMIN_KEY
        # The tab keeps it: a reload goes live without asking.
        browser.refresh()
        wait_until(lambda: _text(browser, "#conn") == "live", timeout_s=SEEN_WITHIN_S, what="live after reload")
        assert not browser.find_element(By.ID, "key-form").is_displayed()
