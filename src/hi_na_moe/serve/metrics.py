"""GET /metrics: the server's counters in Prometheus' text format (version 0.0.4), written here
(a few dozen lines; no client library needed)."""

from __future__ import annotations

import time

from ..integrate.tiering import tier_stats

__all__ = ["render_metrics"]

PREFIX = "hina_moe_"


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def render_metrics(server) -> str:
    engine = server.engine
    c = engine.counters
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples) -> None:
        out.append(f"# HELP {PREFIX}{name} {help_}")
        out.append(f"# TYPE {PREFIX}{name} {kind}")
        for labels, value in samples:
            lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            out.append(f"{PREFIX}{name}{lab} {value}")

    metric("ready", "gauge", "1 once warm-up has finished and the engine runs, else 0",
           [({"state": server.state}, int(server.state == "ok" and engine.failure is None))])
    metric("requests_total", "counter", "Sequences submitted to the engine (one per prompt)", [({}, c.requests)])
    metric("requests_finished_total", "counter", "Sequences finished, by finish reason",
           [({"reason": r}, n) for r, n in sorted(c.finished.items())] or [({"reason": "stop"}, 0)])
    metric("requests_rejected_total", "counter", "Requests refused with 429 (queue full)", [({}, c.rejected)])
    metric("http_responses_total", "counter", "HTTP responses, by path and status",
           [({"path": p, "status": s}, n) for (p, s), n in sorted(server.http.items())])
    metric("queue_depth", "gauge", "Sequences waiting for a place in the batch", [({}, engine.queue_depth())])
    metric("batch_size", "gauge", "Sequences decoding now", [({}, engine.batch_size())])
    metric("prefilling", "gauge", "Sequences whose prompt is being prefilled", [({}, engine.prefilling())])
    metric("decode_steps_total", "counter", "Decode steps run", [({}, c.steps)])
    metric("decode_rows_total", "counter", "Rows over all decode steps (divided by the steps: the mean batch size)",
           [({}, c.step_rows)])
    metric("decode_seconds_total", "counter", "Seconds in decode steps", [({}, round(c.step_seconds, 6))])
    metric("prefill_chunks_total", "counter", "Prefill chunks run", [({}, c.prefill_chunks)])
    metric("prefill_seconds_total", "counter", "Seconds in prefill chunks", [({}, round(c.prefill_seconds, 6))])
    metric("cache_seconds_total", "counter", "Seconds copying the batch's cache as rows join and leave",
           [({}, round(c.cache_seconds, 6))])
    metric("prompt_tokens_total", "counter", "Prompt tokens prefilled", [({}, c.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Tokens generated", [({}, c.completion_tokens)])
    now = time.monotonic()
    recent = sum(1 for t in list(c.tokens_window) if now - t <= 10.0)
    metric("generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 seconds",
           [({}, round(recent / 10.0, 3))])
    ttft = list(c.ttft)
    metric("time_to_first_token_seconds", "summary", "Seconds from a request's arrival to its first token "
           "(the last 2048 to 4096 requests)",
           [({"quantile": "0.5"}, round(_quantile(ttft, 0.5), 6)), ({"quantile": "0.99"}, round(_quantile(ttft, 0.99), 6))])
    tier = tier_stats(engine.model)
    if tier.get("memory_tier"):
        hits, misses = tier.get("hits", 0), tier.get("misses", 0)
        metric("memory_tier_hits_total", "counter", "Expert reads the memory tier served from memory", [({}, hits)])
        metric("memory_tier_misses_total", "counter", "Expert reads the memory tier read from the store",
               [({}, misses)])
        metric("memory_tier_hit_rate", "gauge", "hits / (hits + misses) since the model was enabled",
               [({}, round(hits / (hits + misses), 6) if hits + misses else float("nan"))])
    return "\n".join(out) + "\n"
