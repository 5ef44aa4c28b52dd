"""The playground at / in a real headless Chromium (Debian's, driven by Playwright; no browser download)
against `asyncengine serve` on the tiny test model: streaming, stop, concurrent generations, chat, the
API-key prompt and server errors shown in the page."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "reliability"))
from reliability_helpers import chat_model, server_process  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(120)]

CHROMIUM = os.environ.get("ASYNCENGINE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "sk-browser-key"
LONG = 3000  # max tokens of a generation that is stopped long before its end (the KV cache holds 4096)
PAGE_ERRORS: list[str] = []  # uncaught JavaScript errors of the pages


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium, or set ASYNCENGINE_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model(tmp_path_factory, max_position_embeddings=4096)  # room for a long generation


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    srv = server_process.start_server(model, tmp_path_factory.mktemp("pg"), env={"ASYNCENGINE_API_KEY": ""})
    yield srv
    srv.kill()


def open_page(browser, base: str, width: int = 1280):  # noqa: ANN001, ANN201 - playwright objects
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.set_default_timeout(20_000)
    PAGE_ERRORS.clear()
    page.on("pageerror", lambda e: PAGE_ERRORS.append(str(e)))
    page.goto(base + "/")
    return page


def connected(page) -> None:  # noqa: ANN001
    page.wait_for_function("document.getElementById('conn-status').textContent === 'connected'")


def set_params(page, **fields: object) -> None:  # noqa: ANN001
    for name, value in fields.items():
        page.fill(f"#{name}", str(value))


def finish_of(page, index: int = 0) -> str:  # noqa: ANN001 - panels are newest first
    return page.eval_on_selector_all(".run .run-stats", f"els => els[{index}].dataset.finish")


def wait_finished(page, count: int = 1) -> None:  # noqa: ANN001
    page.wait_for_function(
        f"[...document.querySelectorAll('.run .run-stats')].slice(0, {count})"
        f".filter(e => e.dataset.finish).length === {count}"
    )


def test_streams_a_completion_with_live_figures(browser, server) -> None:  # noqa: ANN001
    page = open_page(browser, server.base)
    connected(page)
    assert "max_model_len 4096" in page.inner_text("#model-info")
    # every change of the output text, as the page shows it
    page.evaluate(
        """() => { window.lengths = [];
        new MutationObserver(() => { const g = document.querySelector('.run .run-gen');
          if (g) window.lengths.push(g.textContent.length); })
        .observe(document.getElementById('runs'), {subtree: true, childList: true, characterData: true}); }"""
    )
    page.fill("#prompt", "def add(a, b):")
    set_params(page, temperature=0, max_tokens=48)
    page.click("#send")
    wait_finished(page)
    assert finish_of(page) in ("length", "stop")
    lengths = page.evaluate("window.lengths")
    assert len(set(lengths)) >= 3, lengths  # the text grew over several frames
    stats = page.inner_text(".run .run-stats")
    assert "TTFT" in stats and "tokens/s" in stats and "finish:" in stats, stats
    assert page.inner_text(".run .run-prompt") == "def add(a, b):"  # continued in place
    assert not PAGE_ERRORS


def test_stop_frees_the_request_on_the_server(browser, server) -> None:  # noqa: ANN001
    page = open_page(browser, server.base)
    connected(page)
    set_params(page, max_tokens=LONG)
    page.keyboard.press("Control+Enter")
    page.wait_for_function("document.querySelector('.run .run-gen').textContent.length > 20")
    page.keyboard.press("Escape")
    wait_finished(page)
    assert finish_of(page) == "abort"
    deadline = time.monotonic() + 10
    while server_process.metric(server, "num_requests_running") != 0:
        assert time.monotonic() < deadline, "the stopped request still runs on the server"
        time.sleep(0.1)


def test_concurrent_generations_over_one_connection(browser, server, tmp_path: Path) -> None:  # noqa: ANN001
    page = open_page(browser, server.base)
    connected(page)
    # one long generation, then a compare pair (two temperatures side by side) while it runs
    set_params(page, max_tokens=LONG)
    page.click("#send")
    page.wait_for_function("document.querySelector('.run .run-gen').textContent.length > 0")
    set_params(page, max_tokens=24, temperature=1.0)
    page.check("#compare")
    page.fill("#compare-temp", "0")
    page.click("#send")
    wait_finished(page, 2)
    labels = page.eval_on_selector_all(".run .run-label", "els => els.map(e => e.textContent)")
    assert "temperature 1" in labels[1] and "temperature 0" in labels[0], labels
    assert finish_of(page, 2) == ""  # the long one still runs beside them
    assert {finish_of(page, 0), finish_of(page, 1)} <= {"length", "stop"}
    stats = page.eval_on_selector_all(".run .run-stats", "els => els.map(e => e.textContent)")
    assert all("TTFT" in s for s in stats[:2]), stats  # both streamed tokens (greedy text may be empty)
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    print(f"screenshot: {tmp_path / 'playground.png'}")
    page.click("#stop-all")
    wait_finished(page, 3)
    assert finish_of(page, 2) == "abort"


def test_chat_mode_keeps_the_history(browser, server) -> None:  # noqa: ANN001
    page = open_page(browser, server.base, width=390)  # a phone's width
    connected(page)
    page.check("input[name=mode][value=chat]")
    page.fill("#prompt", "Hello there")
    set_params(page, max_tokens=16, temperature=0)
    page.click("#send")
    wait_finished(page)
    page.wait_for_selector("#chat-log li.assistant")
    roles = page.eval_on_selector_all("#chat-log li", "els => els.map(e => e.className)")
    assert roles == ["user", "assistant"]
    assert page.input_value("#prompt") == ""
    # the page fits a phone: no horizontal scrolling
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")


def test_a_server_error_shows_in_the_page(browser, server) -> None:  # noqa: ANN001
    page = open_page(browser, server.base)
    connected(page)
    set_params(page, max_tokens=100_000)  # beyond max_model_len: a 400 error frame
    page.click("#send")
    page.wait_for_selector(".run.failed")
    alert = page.inner_text("#alerts")
    assert "400" in alert, alert
    assert page.inner_text("#conn-status") == "connected"  # an error frame keeps the connection


def test_the_api_key_prompt(browser, model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:  # noqa: ANN001
    srv = server_process.start_server(
        model, tmp_path_factory.mktemp("pgkey"), env={"ASYNCENGINE_API_KEY": KEY}
    )
    try:
        page = open_page(browser, srv.base)
        page.wait_for_selector("#key-form:not([hidden])")
        page.fill("#api-key", "sk-wrong")
        page.click("#key-form button")
        page.wait_for_function("document.getElementById('alerts').textContent.includes('401')")
        assert "401" in page.inner_text("#key-reason")
        page.fill("#api-key", KEY)
        page.click("#key-form button")
        connected(page)  # the websocket took the key as its subprotocol
        assert page.is_hidden("#key-form")
        assert page.evaluate("sessionStorage.getItem('asyncengine.apiKey')") == KEY
        assert page.evaluate("localStorage.length") == 0
        set_params(page, max_tokens=8)
        page.click("#send")
        wait_finished(page)
        assert finish_of(page) in ("length", "stop")
    finally:
        srv.kill()
