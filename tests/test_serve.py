"""hi_na_moe.serve: the continuous-batching engine against the layer below it, and the HTTP server
through the official OpenAI client.

Engine (a tiny random OLMoE in bf16, not enabled and enabled with lossless weights under
scope="all"): a greedy request's tokens equal model.generate's for its prompt alone, whether it
runs alone, inside a full batch of other prompts, joins a batch already decoding (shorter and
longer prompts, so both sides get padded), or is prefilled in chunks; a seeded sampled request
draws the same tokens alone and in a batch; stop strings (across token boundaries, held back
while they may still match), end of sequence and max_tokens; cancelling frees the row; a full
queue, a prompt too long for the context and an id outside the vocabulary are refused; a model
that raises fails every request in flight with the error; stop(drain=True) finishes them.

Server (the shipped model, uvicorn on a free loopback port): completions and chat, streaming and
not, with usage, through `openai`; OpenAI error objects naming the field for malformed bodies and
fields; the API key; body size; 429; 404 for another model; /health while warming; /metrics; a
streaming client that disconnects frees its row.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch
from tiny_models import olmoe

import hi_na_moe
from hi_na_moe.core.native import native_kernels_available
from hi_na_moe.fastpath import linear
from hi_na_moe.serve.engine import Engine, EngineError, QueueFull, SamplingParams, _Text

PROMPTS = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [25], [26, 27, 28, 29]]
NEW = 10


class Tok:
    """Token i decodes as "<i>" (the engine's text path without a real vocabulary)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _tiny(scope: str):
    m = olmoe(layers=2, kv_heads=2)
    m.generation_config.eos_token_id = None  # (random weights: a fixed number of tokens)
    if scope == "all":
        if not native_kernels_available():
            pytest.skip("enabling needs the native kernels")
        hi_na_moe.enable_for_model(m, scope="all", weights="lossless", cache=False)
    return m


@pytest.fixture(scope="module", params=["none", "all"])
def model(request):
    mp = pytest.MonkeyPatch()
    mp.setattr(linear, "MIN_WEIGHTS", 0)  # (its dense layers are below the size worth packing)
    m = _tiny(request.param)
    yield m
    if request.param == "all":
        hi_na_moe.disable_for_model(m)
    mp.undo()


@pytest.fixture(scope="module")
def plain():
    """The tiny model not enabled: PyTorch's kernels give a row the same logits in a batch of any
    size at these shapes (checked under ATEN_CPU_CAPABILITY=default, avx2 and avx512), so a
    batched row's tokens must equal its tokens alone exactly. hi_na_moe's lossless kernels round
    a row differently with the rows beside it (a 1-row and a 2-row tile sum in another order):
    random weights' near-tied logits then pick another token, so the enabled batch is checked on
    the trained shipped model (test_enabled_batch_rows_equal_alone)."""
    return _tiny("none")


def _reference(model, prompt, new=NEW):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


class Collector:
    """Events of several requests, and a wait for all of them to finish."""

    def __init__(self):
        self.events: dict[int, list] = {}
        self.done = threading.Event()
        self.left = 0
        self.lock = threading.Lock()

    def emitter(self, key):
        self.events[key] = []
        with self.lock:
            self.left += 1

        def emit(ev):
            self.events[key].append(ev)
            if ev.finish is not None:
                with self.lock:
                    self.left -= 1
                    if self.left == 0:
                        self.done.set()
        return emit

    def wait(self, timeout=120):
        assert self.done.wait(timeout), "requests did not finish"

    def tokens(self, key):
        """The token ids of a request's text (Tok's "<i>" pieces)."""
        text = "".join(e.text for e in self.events[key])
        return [int(t) for t in text.replace("<", " ").replace(">", " ").split()]

    def finish(self, key):
        return self.events[key][-1].finish


def _engine(model, **kw):
    e = Engine(model, Tok(), **kw)
    e.start()
    return e


def test_greedy_alone_equals_generate(model):
    eng = _engine(model, max_batch=len(PROMPTS))
    try:
        for i, p in enumerate(PROMPTS):
            c = Collector()
            eng.submit(p, SamplingParams(max_tokens=NEW, temperature=0.0), c.emitter(i))
            c.wait()
            assert c.tokens(i) == _reference(model, p) and c.finish(i) == "length"
    finally:
        eng.stop()


def test_greedy_in_a_full_batch_equals_generate(plain):
    model = plain
    want = {i: _reference(model, p) for i, p in enumerate(PROMPTS)}
    eng = _engine(model, max_batch=len(PROMPTS))
    try:
        c = Collector()  # all at once: one batch, rows of different lengths
        for i, p in enumerate(PROMPTS):
            eng.submit(p, SamplingParams(max_tokens=NEW, temperature=0.0), c.emitter(i))
        c.wait()
        for i in range(len(PROMPTS)):
            assert c.tokens(i) == want[i], f"prompt {i} in a batch"
        assert eng.counters.step_rows > eng.counters.steps  # (steps really ran batched)
    finally:
        eng.stop()


def test_joining_a_running_batch_and_chunked_prefill(plain):
    """A long prompt joins rows already decoding (they get padded), a short one joins after it,
    and prompts longer than the chunk are prefilled over several turns."""
    model = plain
    long = list(range(30, 60))
    want = {0: _reference(model, PROMPTS[1], 24), 1: _reference(model, long), 2: _reference(model, PROMPTS[3])}
    eng = _engine(model, max_batch=4, prefill_chunk=7)
    try:
        c = Collector()
        eng.submit(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.0), c.emitter(0))
        deadline = time.monotonic() + 60
        while eng.counters.steps < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        eng.submit(long, SamplingParams(max_tokens=NEW, temperature=0.0), c.emitter(1))
        while eng.batch_size() < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        eng.submit(PROMPTS[3], SamplingParams(max_tokens=NEW, temperature=0.0), c.emitter(2))
        c.wait()
        for i in range(3):
            assert c.tokens(i) == want[i], f"request {i}"
        assert eng.counters.prefill_chunks >= 5  # 30 tokens in chunks of 7
    finally:
        eng.stop()


def test_seeded_sampling_is_the_requests_own(plain):
    model = plain
    params = SamplingParams(max_tokens=NEW, temperature=1.3, top_p=0.9, seed=1234)
    eng = _engine(model, max_batch=4)
    try:
        c = Collector()
        eng.submit(PROMPTS[0], params, c.emitter("alone"))
        c.wait()
        c2 = Collector()
        eng.submit(PROMPTS[1], SamplingParams(max_tokens=NEW, temperature=1.0, seed=5), c2.emitter("other"))
        eng.submit(PROMPTS[0], params, c2.emitter("batched"))
        eng.submit(PROMPTS[2], SamplingParams(max_tokens=NEW, temperature=0.7), c2.emitter("unseeded"))
        c2.wait()
        assert c.tokens("alone") == c2.tokens("batched")
        assert len(c.tokens("alone")) == NEW
    finally:
        eng.stop()


def test_cancel_frees_the_row_and_queue_limits(model):
    eng = _engine(model, max_batch=1, max_queue=1)
    try:
        c = Collector()
        s = eng.submit(PROMPTS[0], SamplingParams(max_tokens=400, temperature=0.0), c.emitter(0))
        deadline = time.monotonic() + 60
        while eng.batch_size() < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        eng.submit(PROMPTS[1], SamplingParams(max_tokens=NEW, temperature=0.0), c.emitter(1))  # waits in the queue
        with pytest.raises(QueueFull, match="max_queue 1"):
            eng.submit(PROMPTS[2], SamplingParams(max_tokens=NEW), lambda e: None)
        s.cancel()
        c.wait()
        assert c.finish(0) == "cancelled" and c.finish(1) == "length"
        assert len(c.tokens(0)) < 400 and c.tokens(1) == _reference(model, PROMPTS[1])
        assert eng.batch_size() == 0 and eng.counters.finished["cancelled"] == 1
        with pytest.raises(ValueError, match="max_tokens"):
            eng.submit(PROMPTS[0], SamplingParams(max_tokens=eng.max_context), lambda e: None)
        with pytest.raises(ValueError, match="token id 512 is outside"):
            eng.submit([1, 512], SamplingParams(max_tokens=1), lambda e: None)
        with pytest.raises(ValueError, match="empty"):
            eng.submit([], SamplingParams(max_tokens=1), lambda e: None)
    finally:
        eng.stop()


def test_end_of_sequence_and_stop_strings(plain):
    model = plain
    want = _reference(model, PROMPTS[0])
    eng = Engine(model, Tok(), max_batch=2, eos_token_ids=[want[3]])
    eng.start()
    try:
        c = Collector()
        eng.submit(PROMPTS[0], SamplingParams(max_tokens=NEW, temperature=0.0), c.emitter("eos"))
        eng.submit(PROMPTS[0], SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), c.emitter("ignore"))
        c.wait()
        first = want.index(want[3])
        assert c.tokens("eos") == want[:first] and c.finish("eos") == "stop"
        assert c.tokens("ignore") == want
        # a stop string spanning two tokens' text: ">" of one and "<" of the next
        stop = f"{want[1]}><{want[2]}"
        c = Collector()
        eng.submit(PROMPTS[0], SamplingParams(max_tokens=NEW, temperature=0.0, stop=(stop,), ignore_eos=True),
                   c.emitter("stop"))
        c.wait()
        text = "".join(e.text for e in c.events["stop"])
        assert text == f"<{want[0]}><" and c.finish("stop") == "stop"
    finally:
        eng.stop()


def test_text_holds_back_what_may_become_a_stop_string():
    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    t = _Text(("END",))
    ids, got = [], []
    for ch in "abcENxyEN":
        ids.append(ord(ch))
        out, stopped = t.add(Chars(), ids, False)
        got.append(out)
        assert not stopped
    assert "".join(got) == "abcENxy"  # the last "EN" held back
    ids.append(ord("D"))
    out, stopped = t.add(Chars(), ids, False)
    assert stopped and out == "" and t.text == "abcENxy"
    t = _Text(("END",))
    assert t.add(Chars(), [ord("E")], False) == ("", False)
    assert t.add(Chars(), [ord("E"), ord("N")], True) == ("EN", False)  # the last token: nothing held back


def test_split_characters_are_emitted_whole():
    class Bytes:  # decodes ids as UTF-8 bytes, as a byte-level tokenizer does
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    t = _Text(())
    e = "é".encode()
    assert t.add(Bytes(), [e[0]], False) == ("", False)
    assert t.add(Bytes(), [e[0], e[1]], False) == ("é", False)


def test_a_failing_model_fails_the_requests_in_flight(model, monkeypatch):
    eng = Engine(model, Tok(), max_batch=2)
    calls = [0]
    real = model.forward

    def broken(*a, **kw):
        calls[0] += 1
        if calls[0] > 2:
            raise RuntimeError("boom")
        return real(*a, **kw)

    monkeypatch.setattr(model, "forward", broken)
    eng.start()
    c = Collector()
    eng.submit(PROMPTS[0], SamplingParams(max_tokens=NEW, temperature=0.0), c.emitter(0))
    c.wait()
    ev = c.events[0][-1]
    assert ev.finish == "error" and "RuntimeError: boom" in ev.error
    eng._thread.join(10)
    with pytest.raises(EngineError, match="boom"):
        eng.submit(PROMPTS[0], SamplingParams(max_tokens=1), lambda e: None)


def test_stop_drains_the_requests_in_flight(model):
    eng = _engine(model, max_batch=2)
    c = Collector()
    for i in range(3):
        eng.submit(PROMPTS[i], SamplingParams(max_tokens=NEW, temperature=0.0), c.emitter(i))
    eng.stop(drain=True, timeout=120)
    assert c.done.is_set() and all(c.finish(i) == "length" for i in range(3))
    with pytest.raises(EngineError, match="shutting down"):
        eng.submit(PROMPTS[0], SamplingParams(max_tokens=1), lambda e: None)


@pytest.mark.parametrize("trim", [True, False])
def test_the_heap_is_trimmed_when_the_engine_runs_out_of_work(model, trim):
    """malloc_trim hands freed heap pages back between requests, once per idle spell, never
    while a sequence waits or runs."""
    eng = Engine(model, Tok(), max_batch=2, trim_when_idle=trim)
    if trim:
        assert eng._trim is not None  # (glibc: every Linux the project supports)
        real, busy = eng._trim, []
        eng._trim = lambda pad: busy.append(len(eng._queue) + len(eng._prefilling) + len(eng._rows)) or real(pad)
    eng.start()
    try:
        for rounds in (1, 2):
            c = Collector()
            for i in range(2):
                eng.submit(PROMPTS[i], SamplingParams(max_tokens=NEW, temperature=0.0), c.emitter(i))
            c.wait()
            deadline = time.monotonic() + 60
            while trim and eng.counters.idle_trims < rounds and time.monotonic() < deadline:
                time.sleep(0.01)
            assert eng.counters.idle_trims == (rounds if trim else 0)
        if trim:
            assert busy == [0, 0]
    finally:
        eng.stop()


def test_warm_up_runs_every_batch_size(model):
    eng = Engine(model, Tok(), max_batch=3, prefill_chunk=4)
    seen = []
    eng.warm_up(seen.append)
    assert seen == [f"decode step at batch size {b}" for b in (1, 2, 3)]


# -- the HTTP server ----------------------------------------------------------------------------
fastapi = pytest.importorskip("fastapi", reason="the serve extra: pip install 'hi_na_moe[serve]'")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra: pip install 'hi_na_moe[serve]'")
openai = pytest.importorskip("openai", reason="the tests talk through the official client: pip install openai")
httpx = pytest.importorskip("httpx")

from hi_na_moe.serve.app import create_app  # noqa: E402
from hi_na_moe.serve.protocol import Limits  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    def __init__(self, app):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("the server did not become healthy")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hi_na_moe.tools.commands.common import shipped_model_dir

    path = shipped_model_dir()
    if path is None:
        pytest.skip("the shipped model (models/hina-tiny-moe) is not in this checkout")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    if native_kernels_available():
        hi_na_moe.enable_for_model(model, scope="all", weights="lossless", cache=False)
    return model, tok


@pytest.fixture(scope="module")
def server(shipped):
    model, tok = shipped
    eng = Engine(model, tok, max_batch=4, max_queue=2)
    app = create_app(eng, model_name="tiny", limits=Limits(max_tokens=512, max_prompt_tokens=256),
                     max_body_bytes=4096)
    r = Running(app)
    yield r, eng
    r.stop()


def _client(r, key="unused"):
    return openai.OpenAI(base_url=r.url + "/v1", api_key=key, max_retries=0)


def test_openai_client_completions_and_chat(server, shipped):
    r, eng = server
    model, tok = shipped
    c = _client(r)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    prompt = "Once upon a time"
    ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    ref_ids = ref[:ref.index(eos)] if eos in ref else ref
    want = tok.decode(ref_ids, skip_special_tokens=True)
    got = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(ref_ids)
    assert got.choices[0].finish_reason == ("stop" if eos in ref else "length")
    parts, usage = [], None
    for ch in c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stream=True,
                                   stream_options={"include_usage": True}):
        if ch.choices:
            parts.append(ch.choices[0].text)
        if ch.usage is not None:
            usage = ch.usage
    assert "".join(parts) == want and usage.completion_tokens == len(ref_ids)
    running = [ch.usage.completion_tokens for ch in c.completions.create(
        model="tiny", prompt=ids, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True}) if ch.choices]
    assert running == sorted(running) and running[-1] == len(ref_ids)  # (a chunk a token, and the last)
    two = c.completions.create(model="tiny", prompt=[prompt, "Hello"], max_tokens=5, temperature=0)
    assert sorted(ch.index for ch in two.choices) == [0, 1] and two.choices[0].text == want[:len(two.choices[0].text)]
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                     temperature=0.8, seed=7)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 8
    again = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                      temperature=0.8, seed=7)
    assert again.choices[0].message.content == chat.choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0.8, seed=7,
        stream=True) if ch.choices)
    assert streamed == chat.choices[0].message.content


@pytest.mark.parametrize("body, status, param, words", [
    ('{"prompt": "x", "max_tokens": 0}', 400, "max_tokens", "between 1 and 512"),
    ('{"prompt": "x", "max_tokens": 9999}', 400, "max_tokens", "between 1 and 512"),
    ('{"prompt": "x", "temperature": "hot"}', 400, "temperature", "a number"),
    ('{"prompt": "x", "n": 2}', 400, "n", "not supported"),
    ('{"prompt": "x", "frobnicate": 1}', 400, "frobnicate", "unknown field"),
    ('{"prompt": []}', 400, "prompt", "prompt must be"),
    ('{"max_tokens": 3}', 400, "prompt", "required"),
    ('{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop", "at most 4"),
    ('{"prompt": [1, 99999999]}', 400, "prompt", "outside the model's vocabulary"),
    ('{"prompt": "x", "model": "other"}', 404, "model", "does not exist"),
    ('{"prompt": ', 400, None, "not valid JSON"),
    ('[1, 2]', 400, None, "JSON object"),
])
def test_errors_name_the_field(server, body, status, param, words):
    r, _ = server
    resp = httpx.post(r.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_chat_errors_and_limits(server):
    r, _ = server
    bad = httpx.post(r.url + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].role"
    big = httpx.post(r.url + "/v1/completions", json={"prompt": "x" * 5000})
    assert big.status_code == 413 and "4096" in big.json()["error"]["message"]
    long = httpx.post(r.url + "/v1/completions", json={"prompt": list(range(1, 300))})
    assert long.status_code == 400 and "limit of 256" in long.json()["error"]["message"]


def test_full_queue_answers_429_and_disconnect_frees_the_row(server):
    r, eng = server
    before = eng.counters.finished["cancelled"]
    streams = []
    client = httpx.Client(timeout=60)
    try:
        for _ in range(eng.max_batch):  # fill the batch with long streams
            req = client.build_request("POST", r.url + "/v1/completions",
                                       json={"prompt": "Once", "max_tokens": 500, "stream": True, "ignore_eos": True})
            resp = client.send(req, stream=True)
            assert resp.status_code == 200
            lines = resp.iter_lines()  # (kept: dropping the iterator closes the response)
            next(lines)  # its first token: it is in the batch
            streams.append((resp, lines))
        for _ in range(eng.max_queue):  # the queue's places: accepted, waiting (not read)
            req = client.build_request("POST", r.url + "/v1/completions",
                                       json={"prompt": "Once", "max_tokens": 1, "stream": True})
            streams.append((client.send(req, stream=True), None))
        full = httpx.post(r.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert full.status_code == 429 and full.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        for resp, _ in streams:
            resp.close()
        client.close()
    deadline = time.monotonic() + 60
    while (eng.batch_size() or eng.queue_depth() or eng.prefilling()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.batch_size() == 0 and eng.counters.finished["cancelled"] >= before + eng.max_batch


def test_finished_requests_leave_nothing_behind(server, monkeypatch):
    """The soak's "memory flat" target at the level of objects: once its response is over, no
    request's Sequence (its prompt, tokens, generator, cache, emit closure over the route's
    queue) is still reachable, whichever way it ended: non-streaming, streaming, a chat with stop
    strings, or a stream its client closed."""
    import gc
    import weakref

    r, eng = server
    refs = []
    submit = eng.submit

    def tracked(*a, **kw):
        seq = submit(*a, **kw)
        refs.append(weakref.ref(seq))
        return seq

    monkeypatch.setattr(eng, "submit", tracked)
    with httpx.Client(timeout=60) as client:
        for i in range(3):
            ok = client.post(r.url + "/v1/completions", json={"prompt": f"Once {i}", "max_tokens": 3})
            assert ok.status_code == 200
            with client.stream("POST", r.url + "/v1/completions",
                               json={"prompt": "The dog", "max_tokens": 3, "stream": True}) as s:
                assert s.status_code == 200 and list(s.iter_lines())[-2:] == ["data: [DONE]", ""]
            stop = client.post(r.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                     "max_tokens": 4, "stop": ["a", "e", " "]})
            assert stop.status_code == 200
            with client.stream("POST", r.url + "/v1/completions",
                               json={"prompt": "Once", "max_tokens": 400, "stream": True, "ignore_eos": True}) as s:
                next(s.iter_lines())  # its first token, then the client goes
    deadline = time.monotonic() + 60
    while (eng.batch_size() or eng.queue_depth() or eng.prefilling()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(refs) == 12
    left = len(refs)
    while left and time.monotonic() < deadline:  # (the route of the closed stream ends at its next event)
        gc.collect()
        left = sum(ref() is not None for ref in refs)  # (no strong reference kept across the collect)
        time.sleep(0.05)
    assert left == 0, (f"{left} of {len(refs)} finished requests still reachable, e.g. from "
                       f"{[type(o).__name__ for o in gc.get_referrers(next(w() for w in refs if w() is not None))]}")


def test_health_metrics_and_api_key(shipped):
    model, tok = shipped
    eng = Engine(model, tok, max_batch=2)
    gate = threading.Event()
    real = eng.warm_up
    eng.warm_up = lambda progress=None: (gate.wait(60), real(progress))
    r = Running.__new__(Running)
    app = create_app(eng, model_name="tiny", api_key="s3cret")
    r.port = _free_port()
    r.url = f"http://127.0.0.1:{r.port}"
    r.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=r.port, log_level="warning"))
    r.thread = threading.Thread(target=r.server.run, daemon=True)
    r.thread.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                h = httpx.get(r.url + "/health")
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert h.status_code == 503 and h.json()["status"] == "warming"
        busy = httpx.post(r.url + "/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer s3cret"})
        assert busy.status_code == 503 and "warming" in busy.json()["error"]["message"]
        gate.set()
        while httpx.get(r.url + "/health").status_code != 200 and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        with pytest.raises(openai.AuthenticationError):
            _client(r, "wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
        assert httpx.get(r.url + "/metrics").status_code == 401
        out = _client(r, "s3cret").completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens <= 2
        text = httpx.get(r.url + "/metrics", headers={"authorization": "Bearer s3cret"}).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        assert values['hina_moe_ready{state="ok"}'] == 1
        assert values["hina_moe_requests_total"] == 1 and values["hina_moe_queue_depth"] == 0
        assert values["hina_moe_generation_tokens_total"] == out.usage.completion_tokens
        assert values['hina_moe_http_responses_total{path="/metrics",status="401"}'] == 1
    finally:
        r.stop()


def test_enabled_batch_rows_equal_alone(shipped):
    """The issue's target: a greedy request gives the same tokens alone and inside a full batch
    (lossless weights, scope="all"), here on the trained shipped model, whose logits are not
    near-tied like random weights' (see `plain`): all at once, and joining a running batch."""
    model, tok = shipped
    texts = ["Once upon a time", "The little dog ran to the", "She opened the door and saw",
             "In the morning, the children went to school and", "Hello"]
    prompts = [tok(t)["input_ids"] for t in texts]
    eng = Engine(model, tok, max_batch=len(texts), prefill_chunk=8)
    eng.eos = set()  # (a fixed number of tokens)
    eng.start()
    try:
        alone = []
        for i, p in enumerate(prompts):
            c = Collector()
            eng.submit(p, SamplingParams(max_tokens=24, temperature=0.0), c.emitter(i))
            c.wait()
            alone.append("".join(e.text for e in c.events[i]))
        c = Collector()
        for i, p in enumerate(prompts):
            eng.submit(p, SamplingParams(max_tokens=24, temperature=0.0), c.emitter(i))
        c.wait()
        assert ["".join(e.text for e in c.events[i]) for i in range(len(prompts))] == alone
        c = Collector()
        for i, p in enumerate(prompts):  # each joins rows already decoding
            eng.submit(p, SamplingParams(max_tokens=24, temperature=0.0), c.emitter(i))
            deadline = time.monotonic() + 60
            while eng.batch_size() < i + 1 and time.monotonic() < deadline:
                time.sleep(0.001)
        c.wait()
        assert ["".join(e.text for e in c.events[i]) for i in range(len(prompts))] == alone
        assert eng.counters.step_rows > eng.counters.steps
    finally:
        eng.stop()


def test_cli_refuses_bad_options(capsys):
    from hi_na_moe.tools.cli import main

    assert main(["serve", "--model", "builtin", "--max-batch", "0"]) == 2
    assert "--max-batch must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--model", "/nonexistent/dir", "--port", "8000"]) == 2
    assert "/nonexistent/dir" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "builtin", "--port", str(port)]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
