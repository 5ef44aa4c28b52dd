"""The playground at / in a real headless Chromium (Debian's, driven by Playwright; no browser download)
against `asyncengine serve` on the tiny test model: streaming, stop, concurrent generations, chat,
structured output, the model card in the header, the API-key prompt, server errors (400, 413, 429, 503,
a dead engine) and a dropped connection shown in the page, labels and keyboard, phone and desktop widths,
and no request leaving the server's origin."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "reliability"))
from reliability_helpers import chat_model, server_process, stop, worker_pids  # noqa: E402

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
# max tokens of a generation that is stopped long before its end (the context, and the servers' 256 KV blocks
# of 64 tokens, hold 16,384). 3,000 of 4,096 were outrun: the tiny model made them while the page set up a
# compare pair beside it (CI, 2026-12-07)
LONG = 12_000
# ... with EOS ignored: the tiny model's distribution is near uniform over 512 tokens, so a sampled
# generation meets EOS after ~500 tokens on average and ~10% of them within the first 50
FRAME_LIMIT = 20_000  # the server's --max-frame-bytes: a longer prompt's frame gets a 413
LIVE_LIMIT = 3  # the server's --max-live-per-connection: one more gets a 429
PAGE_ERRORS: list[str] = []  # uncaught JavaScript errors of the pages
REQUESTS: list[str] = []  # every URL the page asked for, websockets included
SENT: list[dict] = []  # the frames the page sent over its websockets


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
    return chat_model(tmp_path_factory, max_position_embeddings=16384)  # room for a long generation


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    srv = server_process.start_server(
        model,
        tmp_path_factory.mktemp("pg"),
        "--max-frame-bytes",
        str(FRAME_LIMIT),
        "--max-live-per-connection",
        str(LIVE_LIMIT),
        env={"ASYNCENGINE_API_KEY": ""},
    )
    yield srv
    srv.kill()


def open_page(browser, base: str, width: int = 1280, before=None):  # noqa: ANN001, ANN201 - playwright objects
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.set_default_timeout(20_000)
    PAGE_ERRORS.clear()
    REQUESTS.clear()
    SENT.clear()
    page.on("pageerror", lambda e: PAGE_ERRORS.append(str(e)))
    page.on("request", lambda r: REQUESTS.append(r.url))

    def on_socket(ws) -> None:  # noqa: ANN001
        REQUESTS.append(ws.url)
        ws.on("framesent", lambda payload: SENT.append(json.loads(payload)))

    page.on("websocket", on_socket)
    if before is not None:  # routes to set up before the page loads
        before(page)
    page.goto(base + "/")
    return page


def connected(page) -> None:  # noqa: ANN001
    page.wait_for_function("document.getElementById('conn-status').textContent === 'connected'")


def set_params(page, **fields: object) -> None:  # noqa: ANN001
    for name, value in fields.items():
        page.fill(f"#{name}", str(value))


def long_generations(page) -> None:  # noqa: ANN001
    set_params(page, max_tokens=LONG)
    page.check("#ignore_eos")


def finish_of(page, index: int = 0) -> str:  # noqa: ANN001 - panels are newest first
    return page.eval_on_selector_all(".run .run-stats", f"els => els[{index}].dataset.finish")


def alerts(page) -> str:  # noqa: ANN001
    return page.inner_text("#alerts")


def generated(page) -> str:  # noqa: ANN001 - the newest panel's generated text
    return page.eval_on_selector(".run .run-gen", "e => e.textContent")


def wait_finished(page, count: int = 1) -> None:  # noqa: ANN001
    page.wait_for_function(
        f"[...document.querySelectorAll('.run .run-stats')].slice(0, {count})"
        f".filter(e => e.dataset.finish).length === {count}"
    )


def test_streams_a_completion_with_live_figures(browser, server) -> None:  # noqa: ANN001
    page = open_page(browser, server.base)
    connected(page)
    header = page.inner_text("#model-info")  # the server's /v1/models card
    assert "max_model_len 16384" in header and "float32" in header, header
    assert "tp 1 × pp 1 × dp 1 (mp)" in header, header
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
    # no CDN, fonts or anything else from the network: every request stays on the server
    host = server.base.removeprefix("http://")
    assert REQUESTS and all(re.match(rf"(http|ws)://{re.escape(host)}/", u) for u in REQUESTS), REQUESTS


def test_stop_frees_the_request_on_the_server(browser, server) -> None:  # noqa: ANN001
    page = open_page(browser, server.base)
    connected(page)
    long_generations(page)
    page.keyboard.press("Control+Enter")
    page.wait_for_function("document.querySelector('.run .run-gen').textContent.length > 20")
    assert SENT[-1]["params"]["ignore_eos"] is True and SENT[-1]["params"]["max_tokens"] == LONG
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
    long_generations(page)
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
        page.reload()  # the tab keeps its key: no prompt again
        connected(page)
        assert page.is_hidden("#key-form")
    finally:
        srv.kill()


def choose_structured(page, kind: str, value: str) -> None:  # noqa: ANN001
    page.select_option("#so-kind", kind)
    page.fill("#so-value", value)


def test_structured_output_in_both_modes(browser, server) -> None:  # noqa: ANN001
    page = open_page(browser, server.base)
    connected(page)
    assert page.is_hidden("#so-value")  # none by default
    # completion mode, a choice; Ctrl+Enter sends from the box too
    set_params(page, temperature=0, max_tokens=16)
    choose_structured(page, "choice", "yes\nno")
    page.press("#so-value", "Control+Enter")
    wait_finished(page)
    assert generated(page) in ("yes", "no") and finish_of(page) == "stop", generated(page)
    assert SENT[-1]["params"]["structured_outputs"] == {"choice": ["yes", "no"]}
    assert "choice" in page.inner_text(".run .run-label")

    # invalid JSON is caught in the page: a clear message at the box, nothing sent
    sent = len(SENT)
    choose_structured(page, "json", '{"type": "object",')
    page.click("#send")
    assert "not valid JSON" in page.inner_text("#so-error")
    assert page.get_attribute("#so-value", "aria-invalid") == "true"
    assert page.evaluate("document.activeElement.id") == "so-value"
    page.fill("#so-value", "[1, 2]")
    assert page.is_hidden("#so-error")  # typing clears the message
    page.click("#send")
    assert "must be a JSON object" in page.inner_text("#so-error")
    assert len(SENT) == sent and page.locator(".run").count() == 1

    # chat mode, a JSON schema: the answer parses and keeps to it
    page.check("input[name=mode][value=chat]")
    page.fill("#prompt", "Pick a colour")
    choose_structured(page, "json", '{"enum": ["red", "green"]}')
    page.click("#send")
    wait_finished(page)
    assert json.loads(generated(page)) in ("red", "green"), generated(page)
    assert SENT[-1]["messages"][-1]["content"] == "Pick a colour"
    assert SENT[-1]["params"]["structured_outputs"] == {"json": {"enum": ["red", "green"]}}
    page.wait_for_selector("#chat-log li.assistant")

    # a schema the server cannot compile: its 400 error frame shows as any error does
    page.fill("#prompt", "Again")
    choose_structured(page, "json", '{"type": "nope"}')
    page.click("#send")
    page.wait_for_selector(".run.failed")
    assert "400" in alerts(page) and "structured_outputs.json" in alerts(page), alerts(page)
    assert page.inner_text("#conn-status") == "connected"
    assert not PAGE_ERRORS


def test_413_and_429_show_in_their_panels(browser, server) -> None:  # noqa: ANN001
    page = open_page(browser, server.base)
    connected(page)
    # a frame over --max-frame-bytes is refused unread (its error frame names no request): the page
    # still fails the right panels, both of a compare pair
    page.fill("#prompt", "x" * (FRAME_LIMIT + 5000))
    set_params(page, max_tokens=4)
    page.check("#compare")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.run.failed').length === 2")
    assert all(
        "413" in t
        for t in page.eval_on_selector_all(".run.failed .error", "es => es.map(e => e.textContent)")
    )
    assert "413 too large" in alerts(page), alerts(page)
    # LIVE_LIMIT live generations on one connection, then one more: that one gets a 429
    page.fill("#prompt", "hello")
    long_generations(page)
    page.click("#send")  # two, compared
    page.wait_for_function("document.querySelectorAll('.run .run-gen')[0].textContent.length > 0")
    page.click("#send")  # two more: the fourth is one too many
    page.wait_for_function("document.querySelectorAll('.run.failed').length === 3")
    assert "429 too many requests" in alerts(page), alerts(page)
    assert page.locator(".run:not(.failed):not(.finished)").count() == LIVE_LIMIT
    page.keyboard.press("Escape")
    wait_finished(page, 4)
    assert page.inner_text("#conn-status") == "connected"


def test_a_loading_server_shows_503_then_connects(browser, server) -> None:  # noqa: ANN001
    loading = {"on": True}

    def models(route) -> None:  # noqa: ANN001 - /v1/models answers as while the model loads
        if loading["on"]:
            body = {"error": {"message": "the model is still loading", "type": "server_error", "code": 503}}
            route.fulfill(status=503, json=body)
        else:
            route.continue_()

    page = open_page(browser, server.base, before=lambda p: p.route("**/v1/models", models))
    page.wait_for_function("document.getElementById('conn-status').textContent.includes('503')")
    assert "the model is still loading" in page.inner_text("#conn-status")
    loading["on"] = False
    connected(page)  # retried by itself
    assert "max_model_len 16384" in page.inner_text("#model-info")


def test_a_dropped_connection_reconnects(browser, server) -> None:  # noqa: ANN001
    routes: list = []

    def proxy(ws) -> None:  # noqa: ANN001 - the page's websocket, passed through to the real server
        routes.append((ws, ws.connect_to_server()))

    page = open_page(
        browser, server.base, before=lambda p: p.route_web_socket(re.compile(r".*/v1/ws$"), proxy)
    )
    connected(page)
    long_generations(page)
    page.click("#send")
    page.wait_for_function("document.querySelector('.run .run-gen').textContent.length > 0")
    page_side, server_side = routes[0]
    server_side.close(code=1001, reason="going away")  # the connection drops under the page
    page_side.close(code=1012, reason="service restart")
    page.wait_for_selector(".run.failed")
    assert "connection closed (code 1012: service restart)" in alerts(page), alerts(page)
    connected(page)  # reconnected by itself
    assert len(routes) == 2
    set_params(page, max_tokens=8)
    page.click("#send")
    wait_finished(page)
    assert finish_of(page) in ("length", "stop")


def test_a_dead_engine_shows_503(browser, model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:  # noqa: ANN001
    srv = server_process.start_server(
        model, tmp_path_factory.mktemp("pgdead"), env={"ASYNCENGINE_API_KEY": ""}
    )
    try:
        page = open_page(browser, srv.base)
        connected(page)
        long_generations(page)
        page.click("#send")
        page.wait_for_function("document.querySelector('.run .run-gen').textContent.length > 0")
        os.kill(worker_pids(srv.proc.pid)[0], signal.SIGKILL)
        page.wait_for_selector(".run.failed")
        assert "503" in page.inner_text(".run.failed .error")
        assert "503 server unavailable" in alerts(page), alerts(page)
        # without --restart-workers the server exits: the page says so and keeps trying
        page.wait_for_function("document.getElementById('conn-status').textContent.includes('unreachable')")
        assert "retrying" in page.inner_text("#conn-status")
    finally:
        stop(srv)


def test_every_control_is_labelled(browser, server) -> None:  # noqa: ANN001
    page = open_page(browser, server.base)
    connected(page)
    choose_structured(page, "regex", "[a-z ]+")  # the box shown
    page.check("input[name=mode][value=chat]")
    set_params(page, max_tokens=4)
    page.fill("#prompt", "hi")
    page.click("#send")
    wait_finished(page)  # a panel's buttons too
    # each control has a name a screen reader reads: a <label>, aria-label, or a button's text
    unnamed = page.evaluate(
        """() => [...document.querySelectorAll('input, select, textarea, button')]
        .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
          && !(e.tagName === 'BUTTON' && e.textContent.trim()))
        .map(e => e.outerHTML)"""
    )
    assert unnamed == []
    stops = page.eval_on_selector_all(".run-stop", "es => es.map(e => e.getAttribute('aria-label'))")
    assert stops and all(re.fullmatch(r"Stop r\d+", s) for s in stops), stops


OVERFLOW = """() => [...document.querySelectorAll('body *')]
    .filter(e => e.getClientRects().length && e.getBoundingClientRect().right > window.innerWidth + 0.5)
    .map(e => e.id || e.className || e.tagName)"""


def test_nothing_overflows_a_phone_or_a_desktop(browser, server, tmp_path: Path) -> None:  # noqa: ANN001
    page = open_page(browser, server.base, width=375)
    connected(page)
    # what makes a page wide: unbroken text in a panel, in the chat log and in an alert, the schema box
    page.fill("#prompt", "x" * 400)
    set_params(page, max_tokens=4, temperature=0)
    page.check("#compare")
    page.click("#send")
    wait_finished(page, 2)
    page.check("input[name=mode][value=chat]")
    page.fill("#prompt", "y" * 400)
    choose_structured(
        page, "json", '{"type": "object", "properties": {"' + "z" * 200 + '": {"type": "string"}}}'
    )
    set_params(page, max_tokens=100_000)  # beyond max_model_len: an error in the page
    page.click("#send")
    page.wait_for_selector(".run.failed")
    for width in (375, 1280):
        page.set_viewport_size({"width": width, "height": 900})
        assert page.evaluate(OVERFLOW) == [], width
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), width
        page.screenshot(path=str(tmp_path / f"playground-{width}.png"), full_page=True)
    print(f"screenshots: {tmp_path}")
