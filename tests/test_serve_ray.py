"""`hi-na-moe serve --ray-replicas`: replicas on Ray Serve (hi_na_moe.serve.ray_app).

The first tests need no Ray. The last, marked `ray_cluster` (deselect with -m "not ray_cluster"),
starts a Ray cluster of two nodes on this machine (a head and a second worker process, one CPU
each), deploys two replicas of the shipped model through the command, and checks: the OpenAI
routes answer through Serve's proxy (the official openai client, streaming and not); requests
spread over both replicas; a replica killed under load is replaced, only the requests it held
fail, each with an error saying so, and afterwards requests succeed on both replicas again.
Without Ray installed it is skipped, naming the install command. scripts/test_ray_serve.sh runs
it alone.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hi_na_moe.core.numa import Node
from hi_na_moe.serve import ray_app, ray_proxy

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "hina-tiny-moe"
SEEN_DEAD_S = 10.0  # the longest Serve's router may still route to a replica that just died


def _node(i, cpus):
    return Node(i, frozenset(cpus), None, None)


def test_numa_node_choice():
    two = {0: _node(0, range(0, 4)), 1: _node(1, range(4, 8))}
    assert ray_app.choose_numa_node({0: _node(0, range(8))}, set(range(8)), 3) is None  # one node: no pinning
    assert ray_app.choose_numa_node({}, set(range(8)), 0) is None  # no NUMA support
    assert [ray_app.choose_numa_node(two, set(range(8)), r).id for r in range(4)] == [0, 1, 0, 1]
    # a node none of whose CPUs this process may use is no choice; a memory-only node neither
    assert ray_app.choose_numa_node(two, {0, 1}, 1) is None
    three = {**two, 2: _node(2, ())}
    assert [ray_app.choose_numa_node(three, set(range(8)), r).id for r in range(3)] == [0, 1, 0]


def test_without_ray_the_package_imports_and_the_command_names_the_extra(tmp_path):
    # ray hidden from the import system: the package, the module and the command still load,
    # and --ray-replicas is a one-line error naming the install command
    code = ("import sys; sys.modules['ray'] = None\n"
            "import hi_na_moe, hi_na_moe.serve.ray_app\n"
            "from hi_na_moe.tools.cli import main\n"
            f"sys.exit(main(['serve', '--model', {str(MODEL)!r}, '--ray-replicas', '2']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2, out.stderr
    assert "pip install 'hi_na_moe[ray]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_ray_options_are_named(capsys):
    from hi_na_moe.tools.cli import main

    assert main(["serve", "--model", str(MODEL), "--ray-replicas", "0"]) == 2
    assert "--ray-replicas must be >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "--model", str(MODEL), "--ray-replicas", "1", "--ray-threads", "0"]) == 2
    assert "--ray-threads must be >= 1, got 0" in capsys.readouterr().err


def test_replica_health_check_raises_once_the_engine_failed():
    replica = ray_app.Replica.__new__(ray_app.Replica)  # no model: only the health check's inputs
    replica.ident, replica._app = "r@host:1", None
    replica.engine = SimpleNamespace(failure=None)
    replica.check_health()
    replica.engine.failure = "RuntimeError: boom"
    with pytest.raises(RuntimeError, match="r@host:1: the engine stopped after an error: RuntimeError: boom"):
        replica.check_health()


def _proxy_app(behaviour: str):
    """A stand-in for Ray Serve's proxy app when a replica dies: `silent` ends without a response
    (the proxy sends nothing for an ActorDiedError), `cut` ends a begun stream without its end."""
    async def app(scope, receive, send):
        if behaviour == "cut":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"x-hina-replica", b"r1@host:7")]})
            chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": "Once", "logprobs": None, "finish_reason": None}]}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True})
    return ray_proxy.ReplicaLoss(app)


def test_proxy_middleware_turns_a_lost_replica_into_an_openai_error():
    import asyncio

    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")

    def client(behaviour):
        transport = httpx.ASGITransport(app=_proxy_app(behaviour))
        return openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="unused", max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport, base_url="http://proxy"))

    async def silent():
        with pytest.raises(openai.APIStatusError) as info:
            await client("silent").completions.create(model="m", prompt="x", max_tokens=4)
        return info.value

    async def cut():
        texts = []
        with pytest.raises(openai.APIError) as info:
            async for ch in await client("cut").completions.create(model="m", prompt="x", max_tokens=4, stream=True):
                texts.append(ch.choices[0].text)
        return texts, info.value

    err = asyncio.run(silent())
    assert err.status_code == 502 and err.body["code"] == "replica_lost" and "retry it" in err.body["message"]
    texts, err = asyncio.run(cut())
    assert texts == ["Once"]  # what came before the cut, then the error
    assert err.body["code"] == "replica_lost" and "r1@host:7" in err.message and "incomplete" in err.message


# --- the loopback cluster -----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _kill_tree_of(marker: str) -> None:
    """SIGKILL every process whose command line holds `marker` (the cluster's temp dir: its GCS,
    raylets and agents), and their descendants (the workers, which rename their command line)."""
    procs = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        procs[int(d.name)] = (ppid, cmd)
    doomed = {pid for pid, (_, cmd) in procs.items() if marker in cmd}
    grew = True
    while grew:
        more = {pid for pid, (ppid, _) in procs.items() if ppid in doomed} - doomed
        doomed |= more
        grew = bool(more)
    doomed.discard(os.getpid())
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def cluster():
    if importlib.util.find_spec("ray") is None:  # (not imported here: the cluster's processes use it)
        pytest.skip(f"Ray Serve is not installed: {ray_app.RAY_EXTRA}")
    if not (MODEL / "config.json").is_file():
        pytest.skip("the shipped model (models/hina-tiny-moe) is not in this checkout")
    tmp = tempfile.mkdtemp(prefix="hnr", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # the replicas' packed-expert store: private to this cluster, removed with it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "HINA_MOE_CACHE_DIR": os.path.join(tmp, "store"),
           # the proxy's middleware: a request held by a replica that died says so
           ray_proxy.CALLBACK_ENV: ray_proxy.CALLBACK,
           # token authentication with a token of its own: nothing read from or written to ~/.ray
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.pop("RAY_ADDRESS", None)
    gcs = _free_port()
    common = ["--num-cpus=1", "--object-store-memory=100000000", "--node-ip-address=127.0.0.1",
              "--disable-usage-stats"]
    try:
        for args in (["--head", f"--port={gcs}", "--include-dashboard=false", f"--temp-dir={tmp}"],
                     [f"--address=127.0.0.1:{gcs}"]):
            out = subprocess.run([_ray_bin(), "start", *args, *common], capture_output=True, text=True, env=env,
                                 timeout=120)
            assert out.returncode == 0, f"ray start {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
        yield SimpleNamespace(address=f"127.0.0.1:{gcs}", tmp=tmp, env=env)
    finally:
        _kill_tree_of(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def served(cluster):
    port = _free_port()
    log = open(Path(cluster.tmp) / "serve.log", "w+")
    cmd = [str(Path(sys.executable).with_name("hi-na-moe")), "serve", "--model", str(MODEL), "--weights", "lossless",
           "--scope", "all", "--port", str(port), "--max-batch", "4", "--ray-replicas", "2",
           "--ray-address", cluster.address, "--ray-threads", "1", "--ray-proxy-location", "HeadOnly"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cluster.env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            text = Path(log.name).read_text()
            if "replica(s) ready" in text:
                break
            if proc.poll() is not None:
                raise AssertionError(f"hi-na-moe serve --ray-replicas ended (exit {proc.returncode}):\n{text}")
            time.sleep(0.5)
        else:
            raise AssertionError(f"the replicas were not ready in 240 s:\n{Path(log.name).read_text()}")
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=proc, log=log.name)
    finally:
        proc.send_signal(signal.SIGTERM)  # the command deletes the application, then ends
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _replica_pid(ident: str) -> int:
    m = re.fullmatch(r"[^@]+@[^:]+:(\d+)", ident or "")
    assert m, f"not a replica id: {ident!r}"
    return int(m.group(1))


@pytest.mark.ray_cluster
def test_replicas_on_a_loopback_ray_cluster(served):
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    # the OpenAI routes through Serve's proxy, with the official client
    assert [m.id for m in client.models.list().data] == ["hina-tiny-moe"]
    raw = client.completions.with_raw_response.create(model="hina-tiny-moe", prompt="Once upon a time",
                                                      max_tokens=12, temperature=0)
    out = raw.parse()
    assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
    _replica_pid(raw.headers["x-hina-replica"])
    chat = client.chat.completions.create(model="hina-tiny-moe", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="hina-tiny-moe", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=16, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # greedy is the same on either replica (the same model, loaded the same way)
    texts = {client.completions.create(model="hina-tiny-moe", prompt="Once upon a time", max_tokens=12,
                                       temperature=0).choices[0].text for _ in range(4)}
    assert texts == {out.choices[0].text}

    # load from six clients (streaming and not, raw HTTP and the openai client), each request
    # noting the replica that answered
    results, lock, stop = [], threading.Lock(), threading.Event()

    def load(mode: str):
        stream = mode != "httpx"
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                rec = {"mode": mode, "replica": None, "status": None, "done": False, "error": None,
                       "t": time.monotonic()}
                body = {"model": "hina-tiny-moe", "prompt": "Once upon a time", "max_tokens": 48,
                        "ignore_eos": True, "stream": stream}
                try:
                    if mode == "openai":  # the official client: a lost replica is an exception it raises
                        raw = client.completions.with_raw_response.create(
                            model=body["model"], prompt=body["prompt"], max_tokens=48, stream=True,
                            extra_body={"ignore_eos": True})
                        rec["status"], rec["replica"] = raw.status_code, raw.headers.get("x-hina-replica")
                        last = [ch.choices[0].finish_reason for ch in raw.parse() if ch.choices][-1]
                        rec["done"] = last == "length"
                    else:
                        with c.stream("POST", served.url + "/v1/completions", json=body) as r:
                            rec["status"], rec["replica"] = r.status_code, r.headers.get("x-hina-replica")
                            if r.status_code != 200:
                                rec["body"] = r.read().decode(errors="replace")
                                rec["error"] = json.loads(rec["body"])["error"]
                            elif stream:
                                for line in r.iter_lines():
                                    if line == "data: [DONE]":
                                        rec["done"] = True
                                    elif line.startswith("data: ") and "error" in (event := json.loads(line[6:])):
                                        rec["error"] = event["error"]
                            else:
                                rec["done"] = json.loads(r.read())["usage"]["completion_tokens"] == 48
                except openai.APIError as exc:
                    rec["error"] = exc.body if isinstance(exc.body, dict) else f"{type(exc).__name__}: {exc}"
                    if isinstance(exc, openai.APIStatusError):
                        rec["status"] = exc.status_code
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    rec["error"] = f"{type(exc).__name__}: {exc}"
                rec["end"] = time.monotonic()
                with lock:
                    results.append(rec)

    modes = ("httpx-stream", "httpx", "openai") * 2
    threads = [threading.Thread(target=load, args=(mode,), daemon=True) for mode in modes]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until both replicas have answered a few each
            with lock:
                per = collections.Counter(r["replica"] for r in results if r["done"])
            if len(per) == 2 and min(per.values()) >= 3:
                break
            time.sleep(0.2)
        assert len(per) == 2 and min(per.values()) >= 3, f"the requests did not spread over two replicas: {per}"
        with lock:
            assert all(r["done"] and not r["error"] for r in results), [r for r in results if not r["done"]]

        victim = sorted(per)[0]
        survivor = sorted(per)[1]
        killed_at = time.monotonic()
        os.kill(_replica_pid(victim), signal.SIGKILL)

        # Serve replaces it: a third replica answers, and both live replicas answer again
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with lock:
                later = collections.Counter(r["replica"] for r in results if r["done"] and r["t"] > killed_at)
            new = set(later) - {victim, survivor}
            if new and later[survivor] >= 3 and min(later[n] for n in new) >= 3:
                break
            time.sleep(0.2)
        assert new and later[survivor] >= 3 and min(later[n] for n in new) >= 3, \
            f"no replacement replica answered after {victim} was killed: {later}"
        assert _replica_pid(next(iter(new))) != _replica_pid(victim)
    finally:
        stop.set()
        for t in threads:
            t.join(120)

    failed = [r for r in results if not r["done"] or r["error"]]
    # only requests the killed replica held failed: in flight at the kill, or routed to it in the
    # moment before Serve saw it die; none answered by the survivor; each says what happened
    assert failed, "no request was in flight on the killed replica (the load did not reach it)"
    for r in failed:
        assert r["t"] <= killed_at + SEEN_DEAD_S and r["end"] >= killed_at, r
        assert r["replica"] in (victim, None), r
        assert isinstance(r["error"], dict) and r["error"]["code"] == "replica_lost", r
        assert "retry" in r["error"]["message"], r
    # afterwards everything succeeds
    with lock:
        tail = [r for r in results if r["t"] > killed_at + SEEN_DEAD_S]
    assert tail and all(r["done"] and not r["error"] for r in tail)

