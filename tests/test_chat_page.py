"""The chat page of `qfuse serve` (GET /) in a real browser: Debian's headless Chromium
driven by selenium, against a live server on loopback with the tiny test model
(tests/assets/tiny: the bundled model's tokenizer and 1024-token context, ~4x faster to
decode; served as "default", the bundled model's name) and an API key.

A greedy reply streams in pieces and equals the API's; the page's defaults follow the
model's context, and a conversation longer than the context drops its oldest turns
with a note, every turn answered; lines longer than the page is wide wrap (no horizontal
scrollbar at 1200 px); the favicon is served. The tests skip without
/usr/bin/chromium and /usr/bin/chromedriver (apt: chromium chromium-driver).
"""

from __future__ import annotations

import http.client
import json
import os

import pytest

from .conftest import TINY_MODEL

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip(f"the chat page tests need Debian's chromium and chromium-driver "
                f"({CHROMIUM}, {CHROMEDRIVER}); .ci/run installs them", allow_module_level=True)
pytest.importorskip("selenium")

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

KEY = "test-key"
CONTEXT = 1024  # the test model's, as the bundled model's
DONE = ".msg.assistant[data-done='true'], .msg.error[data-done='true']"


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json",
                              "Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def port(start_server) -> int:
    # One slot: the page's requests run alone, so a greedy reply is the API's.
    return start_server(str(TINY_MODEL), "--served-model-name", "default", "--api-key", KEY,
                        "--max-batch", "1")


def _chromium(profile):
    """Headless Chromium with a fresh profile in the folder profile."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # No network here or in CI: nothing in the background may try to reach out.
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--window-size=1000,900", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    # The network log: every response the page got, the browser's own favicon request too.
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    # An explicit driver path: Selenium Manager (which would download one) never runs.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(10)
    driver.set_script_timeout(10)
    return driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    driver = _chromium(tmp_path_factory.mktemp("chromium"))
    yield driver
    driver.quit()  # stops chromedriver and the browser it started


def _open(driver, port: int) -> WebDriverWait:
    """The page, loaded afresh, with the key typed (the page asks for it: 401)."""
    driver.get(f"http://127.0.0.1:{port}/")
    wait = WebDriverWait(driver, 12)
    wait.until(ec.visibility_of_element_located((By.ID, "key"))).send_keys(KEY)
    return wait


def _say(driver, text: str, timeout: float = 60):
    """Send text (set as the field's value: typing 400 tokens key by key is slow) and
    wait for its reply to finish; the reply's element."""
    before = len(driver.find_elements(By.CSS_SELECTOR, DONE))
    field = driver.find_element(By.ID, "input")
    driver.execute_script("arguments[0].value = arguments[1];", field, text)
    driver.find_element(By.ID, "send").click()
    WebDriverWait(driver, timeout).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, DONE)) > before)
    return driver.find_elements(By.CSS_SELECTOR, DONE)[-1]


def _responses(driver) -> list[tuple[str, int]]:
    """(url, status) of the responses received since the last call."""
    out = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.responseReceived":
            response = message["params"]["response"]
            out.append((response["url"], response["status"]))
    return out


def test_the_page_learns_the_context_and_when_a_conversation_is_over_it(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/health")  # no key needed: the page reads it before one is typed
        assert json.loads(conn.getresponse().read())["context_length"] == CONTEXT
    finally:
        conn.close()
    status, body = _post(port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x " * CONTEXT}], "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert body["error"]["param"] == "messages"


def test_chat_page_streams_the_greedy_reply(browser, port):
    text = "Write a function that reverses a string."
    status, body = _post(port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0})
    expected = body["choices"][0]["message"]["content"]
    assert status == 200 and expected

    _open(browser, port)
    for field, value in (("max-tokens", "24"), ("temperature", "0")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    # Count the reply's updates, to see that it arrives in pieces, not at once.
    browser.execute_script("""
        window.updates = 0;
        new MutationObserver((records) => {
            for (const r of records)
                if (r.target.classList && r.target.classList.contains("assistant"))
                    window.updates++;
        }).observe(document.getElementById("log"), {childList: true, subtree: true});
    """)
    reply = _say(browser, text)
    assert reply.get_attribute("class") == "msg assistant", reply.text
    assert reply.get_property("textContent") == expected
    assert [m.get_property("textContent")
            for m in browser.find_elements(By.CSS_SELECTOR, ".msg.user")] == [text]
    assert browser.execute_script("return window.updates") >= 2


def test_a_conversation_over_the_context_drops_its_oldest_turns(browser, port):
    # A question of ~440 tokens: one fits with a reply of the default 256 tokens, two do
    # not (2 × 385 + 256 > 1024), so every turn from the second drops exactly one.
    code = "def area(width, height):\n    return width * height\n\n" * 25

    def question(i):
        return f"Review part {i} of my code:\n{code}"

    status, body = _post(port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": question(1)}], "max_tokens": 1})
    assert status == 200 and 385 < body["usage"]["prompt_tokens"] <= CONTEXT - 256, body

    wait = _open(browser, port)
    # The page's defaults follow the model's context, read from /health.
    wait.until(lambda d: d.find_element(By.ID, "max-tokens").get_attribute("max") == "1023")
    assert browser.find_element(By.ID, "max-tokens").get_attribute("value") == str(CONTEXT // 4)
    # Greedy, so that the replies (their lengths) are the same on every run.
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("0")

    turns = 3
    for i in range(1, turns + 1):
        reply = _say(browser, question(i))
        assert reply.get_attribute("class") == "msg assistant", reply.text
        assert reply.get_property("textContent").strip(), f"turn {i} got an empty reply"
        notes = browser.find_elements(By.CSS_SELECTOR, ".note")
        assert len(notes) == i - 1
    assert "the oldest turn was dropped" in notes[-1].text and "1024 tokens" in notes[-1].text
    # The dropped turns stay in the log, faded: every question and answer but the last.
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.dropped")) == 2 * (turns - 1)
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")

    # A question too long by itself is an error for that question only: the history stays
    # (only the question is faded: the model does not see it), and the next one is answered.
    reply = _say(browser, code * 3)
    assert reply.get_attribute("class") == "msg error"
    assert "exceeds the model's context of 1024 tokens" in reply.text
    dropped = browser.find_elements(By.CSS_SELECTOR, ".msg.dropped")
    assert len(dropped) == 2 * (turns - 1) + 1
    assert dropped[-1].get_property("textContent") == (code * 3).strip()
    reply = _say(browser, "Thanks. Now write a function that adds two numbers.")
    assert reply.get_attribute("class") == "msg assistant", reply.text
    assert reply.get_property("textContent").strip()
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.error")) == 1


def test_no_horizontal_scrollbar_at_1200_px_with_long_unbroken_lines(browser, port):
    browser.set_window_size(1200, 900)
    try:
        _open(browser, port)
        assert browser.execute_script("return window.innerWidth") == 1200
        browser.find_element(By.ID, "max-tokens").clear()
        browser.find_element(By.ID, "max-tokens").send_keys("4")
        # A word, a URL and an indented line of code longer than the page is wide.
        text = "x" * 300 + "\nhttps://example.com/" + "path/" * 60 + "\n\t\t" + "a.b_c" * 80
        reply = _say(browser, text)
        assert reply.get_attribute("class") == "msg assistant", reply.text
        width = browser.execute_script(
            "const e = document.documentElement; return [e.scrollWidth, e.clientWidth];")
        assert width[0] <= width[1], width
    finally:
        browser.set_window_size(1000, 900)


def test_the_favicon_is_served_and_nothing_the_page_asks_is_missing(port, tmp_path):
    # A browser of its own: one that has the icon cached would not ask for it again.
    driver = _chromium(tmp_path / "chromium")
    try:
        _open(driver, port)
        icon = f"http://127.0.0.1:{port}/favicon.ico"
        seen = []
        # The browser asks for the icon on its own, after the page has loaded.
        WebDriverWait(driver, 12).until(
            lambda d: seen.extend(_responses(d)) or icon in dict(seen))
    finally:
        driver.quit()
    assert dict(seen)[icon] == 200
    missing = [(url, status) for url, status in seen
               if url.startswith(f"http://127.0.0.1:{port}/") and status == 404]
    assert not missing
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/favicon.ico")
        r = conn.getresponse()
        data = r.read()
    finally:
        conn.close()
    assert r.status == 200 and r.getheader("content-type") == "image/vnd.microsoft.icon"
    assert data[:4] == b"\x00\x00\x01\x00" and len(data) < 4096  # an ICO file, and small
