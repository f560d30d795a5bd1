"""An ASGI middleware for Ray Serve's HTTP proxy: a request whose replica died says so.

When a replica's process ends (killed, out of memory, its machine gone) the requests it held
fail in Ray Serve's proxy. Without this, a response not yet begun is uvicorn's bare
"500 Internal Server Error" (text, not OpenAI's error object), and a stream already begun is cut:
the connection closes mid-chunk, which a client sees as a protocol error ("peer closed connection
without sending complete message body") saying nothing of why. With it, the first is a 502 with
OpenAI's error object naming what happened, and the second ends properly with an SSE error event,
which the openai client raises as an APIError.

Ray Serve's proxy takes it from the environment its node was started with (its middlewares
cannot be set per application):
    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=hi_na_moe.serve.ray_proxy.middlewares ray start ...
`hi-na-moe serve --ray-replicas` without --ray-address starts its local cluster so. The proxy then
imports hi_na_moe (and with it torch: about 3 s once, at the proxy's start).
"""

from __future__ import annotations

import json

REPLICA_HEADER = b"x-hina-replica"
LOST = "replica_lost"
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "hi_na_moe.serve.ray_proxy.middlewares"


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": LOST}}).encode()


class ReplicaLoss:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen = {"started": False, "ended": False, "sse": False, "replica": None}

        async def watch(message):
            if message["type"] == "http.response.start":
                seen["started"] = True
                headers = dict(message.get("headers") or [])
                seen["sse"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                seen["replica"] = headers.get(REPLICA_HEADER, b"").decode() or None
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                seen["ended"] = True
            await send(message)

        await self.app(scope, receive, watch)  # (the proxy answers its own exceptions)
        try:
            if not seen["started"]:
                body = _error("the replica holding this request failed before answering (its process ended, or "
                              "Ray Serve could not reach it; the proxy's log says which): the request was not "
                              "completed, retry it (Serve replaces a replica that died)")
                await send({"type": "http.response.start", "status": 502,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
            elif not seen["ended"] and seen["sse"]:
                who = f" {seen['replica']}" if seen["replica"] else ""
                body = _error(f"the replica{who} serving this stream failed mid-stream (its process ended, "
                              "or Ray Serve lost it); "
                              "the text above is incomplete: retry the request")
                await send({"type": "http.response.body", "body": b"data: " + body + b"\n\n"})
        except Exception:  # the client went away as well: nobody to tell
            pass


def middlewares():
    """Ray Serve's proxy callback (CALLBACK_ENV): the middlewares to wrap the proxy with."""
    from starlette.middleware import Middleware  # optional: the serve extra (Starlette, under FastAPI)

    return [Middleware(ReplicaLoss)]
