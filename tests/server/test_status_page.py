"""The status page at GET /, in a real headless browser: the system's chromium driven by Selenium.

The page loads from the server alone (no request leaves the box), shows live numbers that change after a
request, and its chat box streams a reply. The test writes a screenshot (path printed; FREETOKEN_SCREENSHOT_DIR
overrides the pytest tmp dir) for inspection. Skipped where no chromium/chromedriver is installed
(Debian: `apt-get install chromium chromium-driver`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason="no chromium and chromedriver installed"),
]


def test_page_is_self_contained(http):
    """One HTML document; it names no external URL (no CDN: the box may be offline)."""
    response = http.get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", response.text)
    assert 'fetch("/v1/stats")' in response.text or "/v1/stats" in response.text


def test_page_is_open_with_an_api_key(keyed_server):
    """The page holds no data: it answers without the key (its script asks for the key for the API calls)."""
    assert httpx.get(keyed_server.base_url + "/").status_code == 200
    assert httpx.get(keyed_server.base_url + "/v1/stats").status_code == 401


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def test_live_numbers_and_streamed_chat(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60, poll_frequency=0.2)
    text = lambda element_id: browser.find_element(By.ID, element_id).text
    browser.get(server.base_url + "/")
    wait.until(lambda _: text("conn") == "live")
    assert text("model") == "freetoken-test" and text("backend") == "cpu"
    before = int(text("num-generation-tokens"))

    # A request from elsewhere: the page's numbers follow it within a poll or two.
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "ignore_eos": True}
    usage = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
    wait.until(lambda _: int(text("num-generation-tokens")) >= before + usage["completion_tokens"])
    assert text("num-requests") != "0" and "ms" in text("ttft")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#layers > div")) > 0  # the per-layer strip is drawn

    # The chat box streams a reply: several SSE deltas land in the same message element.
    browser.find_element(By.ID, "chat-input").send_keys("Say something.")
    browser.find_element(By.ID, "chat-send").click()
    reply = wait.until(lambda b: b.find_element(By.CSS_SELECTOR, ".msg-assistant[data-done='true']"))
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg-error"), text("chat-log")
    assert reply.text and int(reply.get_attribute("data-chunks")) > 1
    wait.until(lambda _: int(text("num-generation-tokens")) > before + usage["completion_tokens"])

    out = Path(os.environ.get("FREETOKEN_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "status_page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    print(f"status page screenshot: {shot}")
