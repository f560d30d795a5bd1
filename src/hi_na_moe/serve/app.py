"""The HTTP side of `hi-na-moe serve`: OpenAI's routes over the continuous-batching engine.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming as
server-sent events, or not), GET /health, GET /metrics (Prometheus text), GET / (a chat page).
Errors are OpenAI's error objects: {"error": {"message", "type", "param", "code"}}.

Safe by default: the caller chooses the address (the command binds 127.0.0.1 unless told); with an
API key every /v1 route and /metrics need `Authorization: Bearer <key>` (compared in constant
time); request bodies, prompts and max_tokens are bounded (Limits); a full queue answers 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
import time
import uuid
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse

from .engine import Engine, EngineError, Event, QueueFull
from .metrics import render_metrics
from .protocol import Completion, Limits, RequestError, parse_chat, parse_completion

__all__ = ["create_app", "Server"]

WARMING, READY, FAILED = "warming", "ok", "failed"
ROUTES = frozenset({"/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


class Server:
    """What the routes share: the engine, the tokenizer, the model's name, the limits and the state."""

    def __init__(self, engine: Engine, model_name: str, *, limits: Limits, api_key: str | None,
                 max_body_bytes: int, warm_up: bool):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.model_name = model_name
        self.limits = limits
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.state, self.why = (WARMING if warm_up else READY), None
        self.do_warm_up = warm_up
        self.created = int(time.time())
        self.http = {}  # (route, status) -> count
        self.chat_template = bool(getattr(self.tokenizer, "chat_template", None))

    # -- start and stop -----------------------------------------------------------------------
    def start(self) -> None:
        if not self.do_warm_up:
            self.engine.start()
            return

        def warm():
            try:
                self.engine.warm_up()
                self.engine.start()
                self.state = READY
            except Exception as exc:  # the server stays up to say why on /health
                self.state, self.why = FAILED, f"warm-up failed: {type(exc).__name__}: {exc}"

        threading.Thread(target=warm, name="hi-na-moe-warm-up", daemon=True).start()

    # -- prompts ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The chat template's tokens with the assistant's turn opened. A tokenizer without a
        template gets a plain fallback ("role: content" lines, then "assistant:"), which /v1/models
        and the start-up line name: the model never saw that format in training."""
        if self.chat_template:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise RequestError("the prompt has no tokens", param)
        if len(ids) > self.limits.max_prompt_tokens:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than this server's limit of "
                               f"{self.limits.max_prompt_tokens}", param)


def _error(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def create_app(engine: Engine, *, model_name: str, limits: Limits | None = None, api_key: str | None = None,
               max_body_bytes: int = 1 << 20, warm_up: bool = True) -> FastAPI:
    """The FastAPI app serving `engine` (not yet started: the app's start-up warms it up, then
    starts it; its shutdown drains it)."""
    server = Server(engine, model_name, limits=limits or Limits(), api_key=api_key, max_body_bytes=max_body_bytes,
                    warm_up=warm_up)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start()
        yield
        # uvicorn has waited for the requests in flight; finish what the engine still holds
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, True, 60.0)

    app = FastAPI(title="hi_na_moe", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        path = request.url.path
        key = (path if path in ROUTES else "other", response.status_code)  # (bounded: not by what clients send)
        server.http[key] = server.http.get(key, 0) + 1
        return response

    def authorise(request: Request) -> None:
        if server.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), server.api_key):
            raise RequestError("a valid API key is required: send the header 'Authorization: Bearer <key>'",
                               status=401, code="invalid_api_key")

    async def read_json(request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > server.max_body_bytes:
            raise RequestError(f"the request body is {length} bytes, more than this server's limit of "
                               f"{server.max_body_bytes}", status=413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > server.max_body_bytes:
                raise RequestError(f"the request body is more than this server's limit of {server.max_body_bytes} "
                                   "bytes", status=413)
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}") from None

    def check_ready(model: str | None) -> None:
        if server.state != READY:
            raise RequestError(f"the server is {server.state}" + (f": {server.why}" if server.why else
                               ", try again shortly"), status=503, kind="server_error")
        if engine.failure is not None:
            raise RequestError(f"the engine stopped after an error: {engine.failure}", status=503, kind="server_error")
        if model is not None and model != server.model_name:
            raise RequestError(f"the model {model!r} does not exist here: this server serves {server.model_name!r}",
                               "model", status=404, code="model_not_found")

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError):
        return _error(exc)

    @app.get("/health")
    async def health():
        body = {"status": server.state}
        if server.why:
            body["reason"] = server.why
        if engine.failure:
            body = {"status": FAILED, "reason": f"the engine stopped after an error: {engine.failure}"}
        return JSONResponse(body, status_code=200 if body["status"] == READY else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        authorise(request)
        return PlainTextResponse(render_metrics(server), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        authorise(request)
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "hi_na_moe",
                                            "chat_template": "the tokenizer's" if server.chat_template else
                                            "fallback: 'role: content' lines (the tokenizer has none)"}]}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(resources.files(__package__).joinpath("static/chat.html").read_text())

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorise(request)
        req = parse_completion(await read_json(request), server.limits)
        check_ready(req.model)
        prompts = [server.encode(p) if isinstance(p, str) else list(p) for p in req.prompts]
        for ids in prompts:
            server.check_prompt(ids, "prompt")
        return await _respond(server, request, req, prompts)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        authorise(request)
        req = parse_chat(await read_json(request), server.limits)
        check_ready(req.model)
        ids = server.chat_ids(req.messages)
        server.check_prompt(ids, "messages")
        return await _respond(server, request, req, [ids])

    return app


def _submit(server: Server, req: Completion, prompts: list[list[int]]):
    """Submit every prompt; (the sequences, the queue their events arrive on as (index, Event))."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    seqs = []
    try:
        for i, ids in enumerate(prompts):
            def emit(ev: Event, i=i):
                loop.call_soon_threadsafe(queue.put_nowait, (i, ev))
            seqs.append(server.engine.submit(ids, req.params, emit))
    except QueueFull as exc:
        for s in seqs:
            s.cancel()
        raise RequestError(f"the server is busy: {exc}; retry later", status=429, code="rate_limit_exceeded",
                           kind="rate_limit_error") from None
    except ValueError as exc:
        for s in seqs:
            s.cancel()
        raise RequestError(str(exc), "messages" if req.chat else "prompt") from None
    except EngineError as exc:
        for s in seqs:
            s.cancel()
        raise RequestError(str(exc), status=503, kind="server_error") from None
    return seqs, queue


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _respond(server: Server, request: Request, req: Completion, prompts: list[list[int]]) -> Response:
    seqs, queue = _submit(server, req, prompts)
    rid = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    name = server.model_name
    if req.stream:
        return StreamingResponse(_stream(req, prompts, seqs, queue, rid, created, name), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    texts = [[] for _ in seqs]
    finish: list = [None] * len(seqs)
    prompt_tokens = completion_tokens = 0
    try:
        left = len(seqs)
        while left:
            try:
                i, ev = await asyncio.wait_for(queue.get(), 1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():  # nobody to answer: free the slots
                    return Response(status_code=499)
                continue
            texts[i].append(ev.text)
            if ev.finish is not None:
                left -= 1
                finish[i] = ev
                prompt_tokens += ev.prompt_tokens
                completion_tokens += ev.completion_tokens
    finally:
        for s in seqs:
            s.cancel()  # (a no-op for the finished)
    errors = [ev for ev in finish if ev.finish == "error"]
    if errors:
        raise RequestError(f"generation failed: {errors[0].error}", status=500, kind="server_error")
    if req.chat:
        ev = finish[0]
        choices = [{"index": 0, "message": {"role": "assistant", "content": "".join(texts[0])},
                    "finish_reason": ev.finish, "logprobs": None}]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": "".join(texts[i]), "logprobs": None, "finish_reason": finish[i].finish}
                   for i in range(len(seqs))]
        obj = "text_completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": name, "choices": choices,
                         "usage": _usage(prompt_tokens, completion_tokens)})


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _stream(req: Completion, prompts: list[list[int]], seqs, queue: asyncio.Queue, rid: str, created: int,
                  name: str):
    chat = req.chat
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices, usage=None):
        out = {"id": rid, "object": obj, "created": created, "model": name, "choices": choices}
        if usage is not None or req.include_usage or req.continuous_usage:
            out["usage"] = usage
        return _sse(out)

    prompt_tokens = completion_tokens = 0
    counts = [0] * len(seqs)  # tokens so far, a choice (continuous_usage_stats)
    lengths = [len(p) for p in prompts]
    try:
        if chat:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        left = len(seqs)
        while left:
            i, ev = await queue.get()
            if ev.finish == "error":
                yield _sse(RequestError(f"generation failed: {ev.error}", status=500, kind="server_error").body())
                left -= 1
                continue
            counts[i] += ev.tokens
            running = _usage(lengths[i], counts[i]) if req.continuous_usage else None
            if ev.text or (running is not None and ev.tokens):
                yield chunk([{"index": i, "delta": {"content": ev.text}, "logprobs": None, "finish_reason": None}
                             if chat else {"index": i, "text": ev.text, "logprobs": None, "finish_reason": None}],
                            running)
            if ev.finish is not None:
                left -= 1
                prompt_tokens += ev.prompt_tokens
                completion_tokens += ev.completion_tokens
                done = _usage(ev.prompt_tokens, ev.completion_tokens) if req.continuous_usage else None
                yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": ev.finish} if chat else
                             {"index": i, "text": "", "logprobs": None, "finish_reason": ev.finish}], done)
        if req.include_usage:
            yield chunk([], _usage(prompt_tokens, completion_tokens))
        yield b"data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): free the slots at the engine's next turn
        for s in seqs:
            s.cancel()


def run(model, tokenizer, *, model_name: str = "model", host: str = "127.0.0.1", port: int = 8000,
        max_batch: int = 16, max_queue: int | None = None, prefill_chunk: int = 64, max_context: int | None = None,
        limits: Limits | None = None, api_key: str | None = None, max_body_bytes: int = 1 << 20,
        warm_up: bool = True, log_level: str = "info") -> None:
    """Serve `model` (a transformers causal LM, enabled with hi_na_moe or not) and `tokenizer` on
    host:port until interrupted (Ctrl-C or SIGTERM: new connections are refused, the requests in
    flight finish, then the process ends)."""
    import uvicorn  # optional: the serve extra

    engine = Engine(model, tokenizer, max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                    max_context=max_context)
    app = create_app(engine, model_name=model_name, limits=limits, api_key=api_key, max_body_bytes=max_body_bytes,
                     warm_up=warm_up)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=120)
