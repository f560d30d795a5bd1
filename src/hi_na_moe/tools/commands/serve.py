"""`hi-na-moe serve`: an OpenAI-compatible server over a model loaded with hi_na_moe."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path

import torch

from ...core.checkpoint import CheckpointError, PickleRefused
from ...core.config import ConfigError
from ...integrate.loading import from_pretrained
from . import common
from .common import UserError, shipped_model_dir

SERVE_EXTRA = "pip install 'hi_na_moe[serve]' (FastAPI and uvicorn)"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_port(host: str, port: int) -> None:
    """A UserError when host:port cannot be listened on (in use, not this machine's address)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"--host {host!r} cannot be resolved: {exc}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}",
                            "choose another --port, or stop what listens there") from None


def cmd_serve(args) -> int:
    """Check the options, load (packing the experts), then serve until interrupted."""
    try:
        from ...serve.app import run  # optional: the serve extra (FastAPI, uvicorn)
        from ...serve.protocol import Limits
        import uvicorn  # noqa: F401  optional: the serve extra
    except ImportError as exc:
        raise UserError(f"hi-na-moe serve needs FastAPI and uvicorn ({exc})", SERVE_EXTRA) from None
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    for name in ("max_batch", "prefill_chunk", "max_tokens", "max_prompt_tokens", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_queue is not None and args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_context is not None and args.max_context < 2:
        raise UserError(f"--max-context must be >= 2, got {args.max_context}")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    api_key = args.api_key or os.environ.get("HINA_MOE_API_KEY") or None
    if not _loopback(args.host) and api_key is None:
        print(f"hi-na-moe serve: warning: listening on {args.host} without an API key: anyone who reaches this "
              "address can use the model (set --api-key or HINA_MOE_API_KEY)", file=sys.stderr)
    path = shipped_model_dir() if args.model == "builtin" else Path(args.model)
    if path is None:
        raise UserError("--model builtin: the shipped model (models/hina-tiny-moe) is not in this installation",
                        "pass --model PATH")
    tok_dir = Path(args.tokenizer) if args.tokenizer else path
    if not ((tok_dir / "tokenizer.json").is_file() or (tok_dir / "tokenizer_config.json").is_file()):
        raise UserError(f"{str(tok_dir)!r} has no tokenizer (tokenizer.json / tokenizer_config.json)",
                        "pass --tokenizer DIR, a directory a tokenizer was saved into")
    if args.ray_replicas is not None:  # the replicas load the model, not this process
        return serve_on_ray(args, path, tok_dir, api_key)
    _check_port(args.host, args.port)  # before a load that may take minutes
    from transformers import AutoTokenizer  # import cost: 0.27 s (measured 2026-12-07)

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if args.weights == "off":
        model, _ = common._load(path, args.dtype)
    else:
        kw = {"scope": args.scope}
        if args.threads is not None:
            kw["threads"] = args.threads
        if args.dtype:
            kw["dtype"] = getattr(torch, args.dtype)
        try:
            model = from_pretrained(path, args.weights, **kw).eval()
        except (OSError, PickleRefused, CheckpointError) as exc:
            raise UserError(str(exc)) from None
        except ConfigError:
            raise
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else None
    if vocab is not None and len(tokenizer) > vocab:
        raise UserError(f"the tokenizer in {str(tok_dir)!r} has {len(tokenizer)} tokens, more than the model's "
                        f"vocabulary of {vocab}", "pass the model's own tokenizer with --tokenizer")
    name = args.served_model_name or path.resolve().name
    limits = Limits(max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens,
                    default_max_tokens=min(256, args.max_tokens))
    print(f"hi-na-moe serve: {name} ({args.weights}, scope={args.scope}) on http://{args.host}:{args.port}  "
          f"max batch {args.max_batch}, prefill chunk {args.prefill_chunk} tokens"
          + ("" if getattr(tokenizer, "chat_template", None) else
             "; the tokenizer has no chat template: /v1/chat/completions uses a plain 'role: content' fallback"),
          file=sys.stderr)
    run(model, tokenizer, model_name=name, host=args.host, port=args.port, max_batch=args.max_batch,
        max_queue=args.max_queue, prefill_chunk=args.prefill_chunk, max_context=args.max_context, limits=limits,
        api_key=api_key, max_body_bytes=args.max_body_bytes, warm_up=not args.no_warm_up,
        log_level=args.log_level)
    return 0


def serve_on_ray(args, path, tok_dir, api_key: str | None) -> int:
    """`hi-na-moe serve --ray-replicas N`: the command's options, checked, handed to ray_app.run."""
    # import cost: transformers, through the engine (0.26 s), paid only by `serve --ray-replicas`
    from ...serve.ray_app import RAY_EXTRA, DeployFailed, RayMissing, ReplicaSpec, import_ray
    from ...serve.ray_app import run as run_on_ray  # import cost: as above

    if args.ray_replicas < 1:
        raise UserError(f"--ray-replicas must be >= 1, got {args.ray_replicas}")
    if getattr(args, "threads", None) is not None:  # this process runs no kernels: it would be ignored
        raise UserError("--threads sets this process's kernel threads; with --ray-replicas each replica has "
                        "--ray-threads threads", "pass --ray-threads instead")
    if args.ray_threads < 1:
        raise UserError(f"--ray-threads must be >= 1, got {args.ray_threads}")
    try:
        import_ray()
    except RayMissing as exc:
        raise UserError(f"hi-na-moe serve --ray-replicas: {exc}", RAY_EXTRA) from None
    spec = ReplicaSpec(model=str(path.resolve()), tokenizer=str(tok_dir.resolve()), weights=args.weights,
                       scope=args.scope, dtype=args.dtype, model_name=args.served_model_name or path.resolve().name,
                       threads=args.ray_threads, max_batch=args.max_batch, max_queue=args.max_queue,
                       prefill_chunk=args.prefill_chunk, max_context=args.max_context, max_tokens=args.max_tokens,
                       max_prompt_tokens=args.max_prompt_tokens, max_body_bytes=args.max_body_bytes,
                       api_key=api_key, warm_up=not args.no_warm_up)
    try:
        run_on_ray(spec, replicas=args.ray_replicas, address=args.ray_address, host=args.host, port=args.port,
            proxy_location=args.ray_proxy_location)
    except ConnectionError as exc:  # no cluster at --ray-address
        raise UserError(f"--ray-address {args.ray_address!r}: cannot join the Ray cluster: {exc}",
                        "start one with `ray start --head`, or leave --ray-address out for a local one") from None
    except DeployFailed as exc:
        raise UserError(f"the replicas on Ray Serve did not start: {exc}",
                        "the replicas' logs are in the Ray session directory (logs/serve/)") from None
    return 0


def add_parser(sub, weight_formats) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming) with "
                       "continuous batching; needs the serve extra")
    p.add_argument("--model", required=True, help="a local model directory, or 'builtin' (the shipped model)")
    p.add_argument("--tokenizer", help="the tokenizer's directory (default: --model)")
    p.add_argument("--weights", choices=tuple(weight_formats) + ("off",), default="int4",
                   help="the experts' packed format (default int4); off: plain transformers, no hi_na_moe")
    p.add_argument("--scope", choices=("experts", "all"), default="all",
                   help="all (default): the whole decode step natively; experts: the MoE experts only")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="load the weights in this dtype (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=None, help="threads of hi_na_moe's kernels (default: the config's: "
                   "every core this process may use)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine "
                   "only; another address without an API key draws a warning)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoding together (default 16)")
    p.add_argument("--max-queue", type=int, default=None, help="requests waiting beyond the batch before the "
                   "server answers 429 (default 4 x --max-batch)")
    p.add_argument("--max-context", type=int, default=None, help="prompt plus output tokens a sequence may reach "
                   "(default: the model's max_position_embeddings)")
    p.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens prefilled between two decode steps "
                   "(default 64): smaller keeps the running streams' token gaps even, larger starts long "
                   "prompts sooner")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and /metrics (or set "
                   "HINA_MOE_API_KEY, which keeps the key out of the process list)")
    p.add_argument("--max-tokens", type=int, default=4096, help="the most max_tokens a request may ask (default 4096)")
    p.add_argument("--max-prompt-tokens", type=int, default=8192, help="the longest prompt taken (default 8192)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="the largest request body (default 1 MiB)")
    p.add_argument("--served-model-name", help="the model's id in /v1/models and responses (default: the "
                   "directory's name)")
    p.add_argument("--no-warm-up", action="store_true", help="skip the warm-up (one prefill chunk and one decode "
                   "step per batch size before /health says ok)")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info")
    p.add_argument("--ray-replicas", type=int, default=None, metavar="N", help="serve N replicas on Ray Serve "
                   "(one per machine or NUMA node) behind its HTTP proxy; needs the ray extra")
    p.add_argument("--ray-address", default=None, help="the Ray cluster to join (default: RAY_ADDRESS, else the "
                   "last one `ray start` started on this machine, else a local one started for this command)")
    p.add_argument("--ray-threads", type=int, default=1, help="threads (and Ray CPUs) per replica (default 1)")
    p.add_argument("--ray-proxy-location", choices=("EveryNode", "HeadOnly"), default="EveryNode",
                   help="where Ray Serve runs its HTTP proxies (default EveryNode)")
    p.set_defaults(func=cmd_serve)
