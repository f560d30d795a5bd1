"""Replicas of `hi-na-moe serve` on Ray Serve, for when one machine is not enough.

Each replica is a Ray actor that loads the model itself (the same path, weights, scope, tokenizer
and dtype as `hi-na-moe serve` takes: the model directory must exist at that path on every node,
a shared or copied directory), warms its Engine up, and answers the same OpenAI routes through the
same FastAPI app (hi_na_moe.serve.app.create_app); Ray Serve's HTTP proxy spreads the requests
over the replicas. Meant as one replica per machine or per NUMA node, each with the threads of
its cores (`threads` = the actor's num_cpus, so Ray places no more replicas on a node than it has
CPUs for).

- The warm-up runs in the replica's constructor, so Serve routes nothing to a replica before its
  engine is warm; the app's own start-up (its lifespan, which Serve runs) then starts the engine.
- Serve's health check calls `check_health`, which raises once the engine has failed: Serve then
  replaces the replica. A replica whose process dies (killed, out of memory) is replaced too;
  only the requests it held fail.
- Every response carries `X-Hina-Replica: <replica id>@<host>:<pid>`, so a client (and the
  loopback test, tests/test_serve_ray.py) can tell which replica answered.
- NUMA: where the machine has more than one NUMA node with CPUs this process may use, a replica
  pins all its threads to node (local rank mod nodes), local rank being Serve's count of this
  deployment's replicas on the node, and sets HINA_MOE_NUMA_NODE so a memory tier binds its
  pool there. With one node (or none) nothing is pinned.

Ray is imported only inside functions here: it is the optional `ray` extra
(pip install 'hi_na_moe[ray]'), and hi_na_moe imports without it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..core import numa
from ..core.checkpoint import safetensors_only
from ..integrate.loading import from_pretrained
from . import ray_proxy
from .engine import Engine
from .protocol import Limits

__all__ = ["RAY_EXTRA", "RayMissing", "ReplicaSpec", "application", "choose_numa_node", "import_ray", "run"]

RAY_EXTRA = "pip install 'hi_na_moe[ray]'"
APP_NAME = "hi_na_moe"
REPLICA_HEADER = "X-Hina-Replica"


class RayMissing(ImportError):
    """Ray Serve is not installed (the `ray` extra)."""


def import_ray():
    """(ray, ray.serve), or RayMissing naming the install command."""
    try:
        import ray  # optional: the ray extra
        from ray import serve  # optional: the ray extra
    except ImportError as exc:
        raise RayMissing(f"replicas on Ray Serve need Ray Serve, which is not installed ({exc}); "
                         f"install it with: {RAY_EXTRA}") from None
    return ray, serve


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads and serves (plain values: it travels to the replicas pickled)."""
    model: str  # an absolute path, the same on every node
    tokenizer: str
    weights: str  # a packed format, or "off" (plain transformers)
    scope: str = "all"
    dtype: str | None = None
    model_name: str = "model"
    threads: int = 1
    max_batch: int = 16
    max_queue: int | None = None
    prefill_chunk: int = 64
    max_context: int | None = None
    max_tokens: int = 4096
    max_prompt_tokens: int = 8192
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    warm_up: bool = True


def choose_numa_node(nodes: dict, allowed: set[int], local_rank: int):
    """The NUMA node (a hi_na_moe.core.numa.Node) a replica of this local rank pins itself to,
    or None when fewer than two nodes have CPUs this process may use (nothing to choose)."""
    usable = [n for _, n in sorted(nodes.items()) if n.cpus & allowed]
    if len(usable) < 2:
        return None
    return usable[local_rank % len(usable)]


def _pin_process(cpus: set[int]) -> None:
    # sched_setaffinity(0) sets one thread only; Ray's threads already run, and the ones started
    # later (the engine's, torch's OpenMP pool, the native pool) inherit their creator's mask
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass


def _place_on_numa_node(local_rank: int) -> str:
    """Pin this replica to its NUMA node when there is a choice; a line saying what was done."""
    if not hasattr(os, "sched_getaffinity"):
        return "NUMA: not Linux, not pinned"
    allowed = os.sched_getaffinity(0)
    node = choose_numa_node(numa.Topology.read().nodes, allowed, local_rank)
    if node is None:
        return "NUMA: one node, not pinned"
    cpus = set(node.cpus & allowed)
    _pin_process(cpus)
    os.environ["HINA_MOE_NUMA_NODE"] = str(node.id)
    return f"NUMA: node {node.id} (CPUs {numa.format_cpulist(cpus)})"


def _local_rank() -> int:
    from ray import serve  # optional: the ray extra

    try:
        rank = serve.get_replica_context().rank
    except Exception:  # outside a replica (a direct test of the class)
        return 0
    return int(getattr(rank, "local_rank", rank) or 0)


def _load(spec: ReplicaSpec):
    """(model, tokenizer) as `hi-na-moe serve` loads them."""
    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer)
    if spec.weights == "off":  # plain transformers, as the command loads it (safetensors only)
        with safetensors_only():
            model = AutoModelForCausalLM.from_pretrained(
                spec.model, dtype=getattr(torch, spec.dtype) if spec.dtype else "auto", use_safetensors=True)
    else:
        kw = {"scope": spec.scope, "threads": spec.threads, "progress": False}
        if spec.dtype:
            kw["dtype"] = getattr(torch, spec.dtype)
        model = from_pretrained(spec.model, spec.weights, **kw)
    return model.eval(), tokenizer


class Replica:
    """One replica's state: the model, its Engine and the app. Serve wraps this class with
    serve.ingress (see `application`); `__serve_build_asgi_app__` hands Serve the app, whose
    lifespan Serve runs after the constructor."""
    def __init__(self, spec: ReplicaSpec):
        self.spec = spec
        self.numa = _place_on_numa_node(_local_rank())
        torch.set_num_threads(spec.threads)
        t0 = time.perf_counter()
        self.model, self.tokenizer = _load(spec)
        self.engine = Engine(self.model, self.tokenizer, max_batch=spec.max_batch, max_queue=spec.max_queue,
                             prefill_chunk=spec.prefill_chunk, max_context=spec.max_context)
        if spec.warm_up:
            self.engine.warm_up()
        self.ident = f"{self._replica_id()}@{socket.gethostname()}:{os.getpid()}"
        self._app = None  # (not `app`: Serve's wrapper owns that name)
        print(f"hi-na-moe replica {self.ident}: {spec.model_name} ({spec.weights}, scope={spec.scope}), "
              f"{spec.threads} thread(s), {self.numa}, loaded and warm in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)

    @staticmethod
    def _replica_id() -> str:
        try:
            from ray import serve  # optional: the ray extra
            return serve.get_replica_context().replica_id.unique_id
        except Exception:
            return "replica"

    def __serve_build_asgi_app__(self):
        from .app import create_app  # optional: the serve extra (FastAPI)
        spec = self.spec
        limits = Limits(max_tokens=spec.max_tokens, max_prompt_tokens=spec.max_prompt_tokens,
                        default_max_tokens=min(256, spec.max_tokens))
        # warm already (the constructor): the lifespan only starts the engine
        app = create_app(self.engine, model_name=spec.model_name, limits=limits, api_key=spec.api_key,
                         max_body_bytes=spec.max_body_bytes, warm_up=False)
        ident = self.ident

        @app.middleware("http")
        async def name_replica(request, call_next):
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = ident
            return response

        self._app = app
        return app

    def check_health(self) -> None:
        """Serve's health check: raise (and Serve replaces this replica) once the engine failed."""
        if self.engine.failure is not None:
            raise RuntimeError(f"hi_na_moe replica {self.ident}: the engine stopped after an error: "
                               f"{self.engine.failure}")
        server = getattr(getattr(self._app, "state", None), "server", None)
        if server is not None and server.state == "failed":
            raise RuntimeError(f"hi_na_moe replica {self.ident}: {server.why}")


def application(spec: ReplicaSpec, *, replicas: int, health_check_period_s: float = 5.0):
    """The Ray Serve application: `replicas` replicas of `spec`, each an actor of spec.threads CPUs."""
    _, serve = import_ray()
    ingress = serve.ingress()(Replica)  # no app here: the replica builds it (__serve_build_asgi_app__)
    max_queue = spec.max_queue if spec.max_queue is not None else 4 * spec.max_batch
    deployment = serve.deployment(
        ingress,
        name="hi_na_moe",
        num_replicas=replicas,
        # the engine batches max_batch sequences at once; the rest wait in Serve's router, which
        # hands each to whichever replica frees a place first (a 503 beyond max_queued_requests)
        max_ongoing_requests=spec.max_batch,
        max_queued_requests=max_queue * replicas,
        health_check_period_s=health_check_period_s,
        ray_actor_options={"num_cpus": spec.threads,
                           "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(spec.threads)}}},
    )
    return deployment.bind(spec)


class DeployFailed(RuntimeError):
    """Serve gave up on the application (its replicas kept failing to start)."""


def _why_failed(serve) -> str | None:
    """The replicas' own error (the last line of the constructor's traceback Serve keeps)."""
    try:
        message = serve.status().applications[APP_NAME].deployments["hi_na_moe"].message
    except Exception:
        return None
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


def _proxy_address(ray) -> tuple[str, int] | None:
    try:
        controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
        opts = ray.get(controller.get_http_config.remote(), timeout=30)
        return opts.host, int(opts.port)
    except Exception:  # a Serve without that actor or method: the address cannot be checked
        return None


def run(spec: ReplicaSpec, *, replicas: int, address: str | None, host: str, port: int,
        proxy_location: str = "EveryNode") -> None:
    """Deploy `replicas` replicas on the Ray cluster at `address` (None: ray.init's choice:
    RAY_ADDRESS, the last cluster `ray start` started here, else a local one for this command),
    serve them on host:port through Serve's HTTP proxy until interrupted, then delete the
    application."""
    ray, serve = import_ray()

    if address is None and not os.environ.get("RAY_ADDRESS"):
        # a local cluster ray.init starts (when `ray start` left none to join) inherits this
        # environment: its proxy gets ReplicaLoss
        os.environ.setdefault(ray_proxy.CALLBACK_ENV, ray_proxy.CALLBACK)
    ray.init(address=address, log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
        # a Serve already running on the cluster keeps its own proxy address (serve.start only logs that)
        got = _proxy_address(ray)
        if got is not None and got != (host, port):
            raise DeployFailed(f"Ray Serve already runs on this cluster with its HTTP proxy on {got[0]}:{got[1]}, "
                               f"not {host}:{port}: pass --host {got[0]} --port {got[1]}, or stop it first "
                               "(`serve shutdown`)")
        t0 = time.perf_counter()
        print(f"hi-na-moe serve: deploying {replicas} replica(s) of {spec.model_name} on Ray "
              f"({ray.get_runtime_context().gcs_address}); each loads the model and warms up", file=sys.stderr,
              flush=True)
        try:
            serve.run(application(spec, replicas=replicas), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as exc:
            raise DeployFailed(_why_failed(serve) or str(exc)) from None
        print(f"hi-na-moe serve: {replicas} replica(s) ready in {time.perf_counter() - t0:.1f} s on "
              f"http://{host}:{port} (Ray Serve's proxy, {proxy_location}); Ctrl-C to stop", file=sys.stderr,
              flush=True)
        # SIGTERM as Ctrl-C: either way the application is deleted before the command ends
        def on_term(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, on_term)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("hi-na-moe serve: stopping: deleting the application", file=sys.stderr, flush=True)
    finally:
        try:
            serve.delete(APP_NAME)
        except Exception:  # nothing was deployed, or the cluster is gone
            pass
        ray.shutdown()
