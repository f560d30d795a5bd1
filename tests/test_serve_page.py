"""The chat page `hi-na-moe serve` shows at / (src/hi_na_moe/serve/static/chat.html), driven in
headless Chromium through Playwright against the real server on the shipped model: streaming,
multi-turn history, Stop freeing the server's slot, the API-key flow, errors shown readably, and
model output shown as text (never as HTML).

Needs Chromium at /usr/bin/chromium (Debian: apt-get install -y chromium; `bash scripts/dev.sh
setup` installs it when run as root) and the playwright package (requirements-dev.txt); never
`playwright install`: the system's Chromium is used. Without either the tests skip, saying which.

Nothing here depends on the tokens the model samples: replies are asked with ignore_eos (added to
the page's request on its way out) so they are never empty, and only their presence, their
streaming and their round trip through the history are checked.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("HINA_CHROMIUM", "/usr/bin/chromium")
INSTALL = ("install Chromium (Debian: apt-get install -y chromium, or run `bash scripts/dev.sh setup` as root) "
           "and playwright (pip install -r requirements-dev.txt)")

if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (HINA_CHROMIUM names another): {INSTALL}", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason=f"playwright is not installed: {INSTALL}")
pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -r requirements-dev.txt")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install -r requirements-dev.txt")

KEY = "page-test-key"
MODEL = "hina-tiny-moe"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 30_000  # generous: two shared cores run the model, the server and Chromium


class Served:
    def __init__(self, url, engine, slow):
        self.url, self.engine, self.slow = url, engine, slow

    def metrics(self) -> str:
        req = urllib.request.Request(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str) -> float:
        m = re.search(rf"^hina_moe_{re.escape(name)} (\S+)$", self.metrics(), re.M)
        return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The shipped model behind the real app (with an API key), served by uvicorn in a thread on
    a socket bound here (port 0: no race for a free port)."""
    import uvicorn
    from transformers import AutoTokenizer

    from hi_na_moe.integrate.loading import from_pretrained
    from hi_na_moe.serve.app import create_app
    from hi_na_moe.serve.engine import Engine
    from hi_na_moe.tools.commands.common import shipped_model_dir

    with pytest.MonkeyPatch.context() as mp:
        # module scope runs before conftest's per-test private store: keep the real store untouched
        mp.setenv("HINA_MOE_CACHE_DIR", str(tmp_path_factory.mktemp("hina-store")))
        path = shipped_model_dir()
        assert path is not None, "the shipped model (models/hina-tiny-moe) is missing"
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = from_pretrained(path, "lossless", scope="all", progress=False).eval()  # as `serve --model builtin --weights lossless`
    # Stop must land while a reply still runs: the tiny model decodes a whole reply in about a
    # second, so the Stop test slows each forward while it needs to
    slow = {"seconds": 0.0}
    model.register_forward_pre_hook(lambda module, args: time.sleep(slow["seconds"]) if slow["seconds"] else None)
    engine = Engine(model, tokenizer, max_batch=2)
    app = create_app(engine, model_name=MODEL, api_key=KEY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # loading and warm-up, on cores others may be busy on
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if json.load(r)["status"] == "ok":
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, "the server did not become ready in 300 s"
        assert thread.is_alive(), "uvicorn stopped before the server became ready"
        time.sleep(0.2)
    try:
        yield Served(url, engine, slow)
    finally:
        uv.should_exit = True
        thread.join(90)
        sock.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        try:
            yield b
        finally:
            b.close()


def _new_page(browser, server, *, with_key: bool):
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    if with_key:
        context.add_init_script(f"localStorage.setItem('hina-moe-api-key', {json.dumps(KEY)})")
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(server.url + "/")
    return page, errors


@pytest.fixture
def page(browser, server):
    page, errors = _new_page(browser, server, with_key=True)
    yield page
    page.context.close()
    assert not errors, f"the page raised: {errors}"


def _never_empty(page):
    """Add ignore_eos to the page's chat requests on their way out (the page never sends it): a
    reply then runs to max_tokens whatever the model samples, so it always has text."""
    def handle(route):
        body = json.loads(route.request.post_data)
        body["ignore_eos"] = True
        route.continue_(post_data=json.dumps(body))
    page.route("**/v1/chat/completions", handle)


def _send(page, text):
    page.fill("#input", text)
    page.press("#input", "Enter")


def _wait_idle(page):
    """Until the reply has ended: the input is enabled again and Stop disabled."""
    page.wait_for_function("() => !document.getElementById('input').disabled"
                           " && document.getElementById('stop').disabled")


def _replies(page):
    return page.locator(".msg.assistant .content").all_text_contents()


def _set_settings(page, *, max_tokens=None, temperature=None):
    if page.get_attribute("#settings", "open") is None:
        page.locator("#settings summary").click()
    if max_tokens is not None:
        page.fill("#max-tokens", str(max_tokens))
        page.dispatch_event("#max-tokens", "change")
    if temperature is not None:
        page.fill("#temperature", str(temperature))
        page.dispatch_event("#temperature", "change")


def test_conversation_streams_and_sends_the_history(page, server):
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL)
    _never_empty(page)
    _set_settings(page, max_tokens=12, temperature=0.8)
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)

    _send(page, "Hello there")
    sync_api.expect(page.locator(".msg.user .content")).to_have_text(["Hello there"])
    _wait_idle(page)
    first = _replies(page)
    assert len(first) == 1 and first[0], f"no reply text after the first turn: {first}"
    assert page.locator("#error").text_content() == ""
    assert page.evaluate("document.activeElement.id") == "input", "the input should have the focus back"

    # Shift+Enter is a new line, not a send
    page.fill("#input", "line one")
    page.press("#input", "Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#input") == "line one\nline two"
    assert len(bodies) == 1
    page.press("#input", "Enter")
    _wait_idle(page)
    replies = _replies(page)
    assert len(replies) == 2 and replies[1], f"no reply text after the second turn: {replies}"

    assert len(bodies) == 2
    assert bodies[0]["messages"] == [{"role": "user", "content": "Hello there"}]
    assert bodies[1]["messages"] == [{"role": "user", "content": "Hello there"},
                                     {"role": "assistant", "content": first[0]},
                                     {"role": "user", "content": "line one\nline two"}]
    for body in bodies:
        assert body["stream"] is True and body["model"] == MODEL
        assert body["max_tokens"] == 12 and body["temperature"] == 0.8
    # max_tokens was reached (ignore_eos): the page says so
    sync_api.expect(page.locator(".msg.assistant .note").first).to_contain_text("max tokens")

    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    _send(page, "A fresh start")
    _wait_idle(page)
    assert bodies[-1]["messages"] == [{"role": "user", "content": "A fresh start"}]


def test_reply_streams_in_and_stop_frees_the_slot(page, server):
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL)
    _never_empty(page)
    _set_settings(page, max_tokens=400)
    cancelled = r'^hina_moe_requests_finished_total\{reason="cancelled"\} (\S+)$'
    before = re.search(cancelled, server.metrics(), re.M)
    before = float(before.group(1)) if before else 0.0
    server.slow["seconds"] = 0.05  # 400 tokens: 20 s at the least; Stop comes long before
    try:
        _send(page, "Tell me a long story")
        # text shows while the reply still runs: streamed, not delivered at the end
        page.wait_for_function("() => document.querySelector('.msg.assistant .content')?.textContent.length > 0")
        assert page.is_disabled("#input") and page.is_enabled("#stop")
        shown = len(_replies(page)[0])
        page.wait_for_function(f"() => document.querySelector('.msg.assistant .content').textContent.length > {shown}")
        page.click("#stop")
        _wait_idle(page)
        sync_api.expect(page.locator(".msg.assistant .note")).to_have_text("Stopped.")
        deadline = time.monotonic() + 20
        while True:
            m = re.search(cancelled, server.metrics(), re.M)
            if m and float(m.group(1)) > before and server.metric("batch_size") == 0:
                break
            assert time.monotonic() < deadline, ("the server did not cancel the stopped reply: "
                                                 f"cancelled {m and m.group(1)}, batch {server.metric('batch_size')}")
            time.sleep(0.1)
    finally:
        server.slow["seconds"] = 0.0
    assert page.locator("#error").text_content() == ""
    # the partial reply stays in the conversation
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    _set_settings(page, max_tokens=4)
    _send(page, "Go on")
    _wait_idle(page)
    assert [m["role"] for m in bodies[0]["messages"]] == ["user", "assistant", "user"]
    assert bodies[0]["messages"][1]["content"] == _replies(page)[0]

    # Esc stops a reply too
    _set_settings(page, max_tokens=400)
    server.slow["seconds"] = 0.05
    try:
        _send(page, "And more")
        page.wait_for_function("() => document.querySelectorAll('.msg.assistant .content')[2]?.textContent.length > 0")
        page.keyboard.press("Escape")
        _wait_idle(page)
    finally:
        server.slow["seconds"] = 0.0
    sync_api.expect(page.locator(".msg.assistant").nth(2).locator(".note")).to_have_text("Stopped.")


def test_api_key_flow(browser, server):
    page, errors = _new_page(browser, server, with_key=False)
    try:
        err = page.locator("#error")
        sync_api.expect(err).to_contain_text("HTTP 401")
        sync_api.expect(err).to_contain_text("a valid API key is required")
        sync_api.expect(page.locator("#model")).to_contain_text("unknown")
        _never_empty(page)
        _send(page, "Hello?")
        _wait_idle(page)
        sync_api.expect(err).to_contain_text("HTTP 401")
        assert page.locator(".msg").count() == 0, "a refused turn stays out of the conversation"
        assert page.input_value("#input") == "Hello?", "the refused text is given back to edit"

        assert page.is_visible("#api-key"), "a 401 opens the settings where the key goes"
        page.fill("#api-key", KEY)
        page.press("#api-key", "Tab")  # change event: stored, the model list read again
        sync_api.expect(page.locator("#model")).to_contain_text(MODEL)
        sync_api.expect(err).to_have_text("")
        assert page.evaluate("localStorage.getItem('hina-moe-api-key')") == KEY
        _set_settings(page, max_tokens=6)
        page.press("#input", "Enter")
        _wait_idle(page)
        assert _replies(page)[0], "no reply once the key was given"
        assert err.text_content() == ""

        page.reload()  # the key is remembered
        sync_api.expect(page.locator("#model")).to_contain_text(MODEL)
        assert page.input_value("#api-key") == KEY
    finally:
        page.context.close()
    assert not errors, f"the page raised: {errors}"


def test_server_refusal_is_shown_with_its_message(page, server):
    """A 400 from the real server (max_tokens above its limit) names the field and the limit."""
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL)
    _set_settings(page, max_tokens=999999)
    _send(page, "Hi")
    _wait_idle(page)
    err = page.locator("#error")
    sync_api.expect(err).to_contain_text("HTTP 400")
    sync_api.expect(err).to_contain_text("max_tokens must be between 1 and 4096, got 999999")
    assert page.locator(".msg").count() == 0
    assert page.input_value("#input") == "Hi"


def _sse(*events) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def _chunk(text=None, finish=None):
    delta = {"content": text} if text is not None else {}
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def test_model_output_is_text_never_html(page, server):
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL)
    evil = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script><b>bold</b>'
    # split mid-tag, so a renderer that parsed each piece as HTML would also be caught
    body = _sse(_chunk(""), _chunk(evil[:7]), _chunk(evil[7:40]), _chunk(evil[40:]), _chunk(finish="stop"), "[DONE]")
    page.route("**/v1/chat/completions",
               lambda route: route.fulfill(status=200, content_type="text/event-stream", body=body))
    _send(page, "<i>also the user's text</i>")
    _wait_idle(page)
    assert _replies(page) == [evil]
    assert page.locator(".msg.user .content").text_content() == "<i>also the user's text</i>"
    assert page.locator("#log img, #log script, #log b, #log i").count() == 0
    page.wait_for_timeout(200)  # an onerror would have fired by now
    assert page.evaluate("window.__pwned") is None


def test_busy_network_and_midstream_errors_are_shown(page, server):
    sync_api.expect(page.locator("#model")).to_contain_text(MODEL)
    err = page.locator("#error")
    busy = {"error": {"message": "the server is busy: 2 sequences are running and 8 requests wait (max_queue 8); "
                                 "retry later", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
    page.route("**/v1/chat/completions",
               lambda route: route.fulfill(status=429, content_type="application/json", body=json.dumps(busy)))
    _send(page, "Hi")
    _wait_idle(page)
    sync_api.expect(err).to_contain_text("HTTP 429")
    sync_api.expect(err).to_contain_text(busy["error"]["message"])
    assert page.locator(".msg").count() == 0 and page.input_value("#input") == "Hi"

    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: route.abort("connectionrefused"))
    page.press("#input", "Enter")
    _wait_idle(page)
    sync_api.expect(err).to_contain_text("Could not reach the server")

    # an error event after some text: the text stays, the error is named
    failed = {"error": {"message": "generation failed: RuntimeError: boom", "type": "server_error", "param": None,
                        "code": None}}
    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=_sse(_chunk(""), _chunk("partial"), failed, "[DONE]")))
    page.press("#input", "Enter")
    _wait_idle(page)
    sync_api.expect(err).to_contain_text("generation failed: RuntimeError: boom")
    assert _replies(page) == ["partial"]
    sync_api.expect(page.locator(".msg.assistant .note")).to_contain_text("Incomplete")

    # a stream that ends without [DONE] is not taken as a finished reply
    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=_sse(_chunk(""), _chunk("cut"))))
    _send(page, "again")
    _wait_idle(page)
    sync_api.expect(err).to_contain_text("closed before the reply finished")
