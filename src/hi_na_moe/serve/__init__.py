"""`hi-na-moe serve`: an OpenAI-compatible HTTP server with continuous batching.

- hi_na_moe.serve.engine: the continuous-batching loop over a transformers causal LM (no HTTP);
- hi_na_moe.serve.app: the OpenAI routes, /health, /metrics and the chat page (FastAPI; the
  `serve` extra: pip install 'hi_na_moe[serve]'), and `run`, the Python entry point;
- hi_na_moe.serve.ray_app: replicas on Ray Serve (the `ray` extra).
"""

from .engine import Engine, EngineError, Event, QueueFull, SamplingParams

__all__ = ["Engine", "EngineError", "Event", "QueueFull", "SamplingParams"]
