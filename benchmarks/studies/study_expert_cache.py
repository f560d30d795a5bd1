"""The memory tier's expert cache and its read prediction, judged on real routing (issue 42).

Three sections (`--sections`, all by default), each writing under --out:

trace    For every --model: the experts each MoE layer routes every token of --data (the first
         --tokens tokens, windows of --seq-len, as `hi-na-moe profile-router` reads the held-out
         text) to, recorded by hi_na_moe's own recorder (`tools.profile_router`, the model not
         enabled), saved as trace-<model>-<tokens>.npz (`top_k_index` [layers, tokens, k] int16,
         `token_ids`, `seq_len`): replayable without the model. A window is one causal forward;
         a decode with a KV cache routes the same tokens the same way up to float rounding, which
         --decode-check windows check by decoding them token by token (the share of (token,
         layer) expert sets that agree is in the JSON).
cache    For every trace: the hit rate of ONE pool of expert slots shared by all layers (a key is
         (layer, expert)) against its size, 10 %..90 % of all layers x experts, under each online
         policy of `core.cache_policy` (LRU, LFU, LRU-2, frequency with decay) and Belady's MIN.
         Replay order: tokens in text order, within a token its layers in order; each layer's k
         experts are one step (resident together while the layer runs, as the tier needs; a
         token's experts of all layers need not be). Also freq-decay at other half-lives
         (--half-lives; chosen on the same trace: in-sample). Per size: the best online policy and
         its hit rate as a share of MIN, against the issue's target (>= 90 % of MIN).
predict  For --predict-model (the E64 model), in transformers alone (forward hooks): at each
         layer l and distance j (l + j < layers), layer (l+j)'s router (its gate linear, softmax,
         top-(k+m)) applied to
           moe_input:  x[l], layer l's MoE input (post_attention_layernorm[l]'s output, what
                       layer l's own router sees), available when layer l routes;
           mid_target: h_mid[l], the residual stream that post_attention_layernorm[l] normalises,
                       through post_attention_layernorm[l+j] (the target layer's norm weights
                       in place of layer l's), available when layer l routes;
           residual:   the residual stream before layer l+1's attention (layer l's output)
                       through post_attention_layernorm[l+j], available when layer l is done,
         against the k experts layer l+j chooses: recall |pred & actual| / k and precision
         |pred & actual| / (k+m), m = 0, 2, 4, 8 extra. Beside them: static (the k+m experts
         layer l+j uses most over the same tokens, in-sample) and random ((k+m)/E). A self-check
         applies each layer's router to its own input and must give its own choice.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/studies/study_expert_cache.py \\
        --model models/hina-moe-e64 --model models/hina-tiny-moe --predict-model models/hina-moe-e64

Question: which replacement policy should the memory tier's expert pool ship with (the issue's
  target: >= 90 % of MIN's hit rate at every size), and which hidden state and how many extra
  experts make the next layers' routers predict their reads (recall >= 80 %)?
Answered in benchmarks/log/memory-tier.md, "The expert pool's policy and read prediction on real
  routing (2026-12-07)".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # a shared machine: no spinning torch workers

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its lib package
from lib import record  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
ONLINE = ("lru", "lfu", "lru-2", "freq-decay")
TARGET_OF_MIN = 0.9
EXTRA = (0, 2, 4, 8)
RECALL_TARGET = 0.8
VARIANTS = ("moe_input", "mid_target", "residual")  # the hidden states prediction may start from


def fail(msg: str) -> None:
    raise SystemExit(f"study_expert_cache: {msg}")


def load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if not (path / "config.json").is_file():
        fail(f"--model {path}: no config.json there (train it: see benchmarks/log/memory-tier.md)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


def token_ids(tok, data: Path) -> torch.Tensor:
    if not data.is_file():
        fail(f"--data {data}: no such file")
    # the held-out text carries its own <|endoftext|> separators (as profile-router --data builtin)
    return torch.tensor(tok(data.read_text(encoding="utf-8"), add_special_tokens=False).input_ids)


def rel(p: Path) -> str:
    """A path as the JSON records it: relative to the repository when inside it."""
    p = p.resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def trace_path(out: Path, model: Path, tokens: int) -> Path:
    return out / f"trace-{model.name}-{tokens}.npz"


# ------------------------------------------------------------------------------------- trace
def gate_hooks(model, sink: list):
    """Hooks appending each layer's chosen experts ([rows, k]) to sink[layer]."""
    hs = []
    for l, layer in enumerate(model.model.layers):
        hs.append(layer.mlp.gate.register_forward_hook(lambda m, a, o, l=l: sink[l].append(o[2].detach().clone())))
    return hs


@torch.no_grad()
def decode_check(model, ids: torch.Tensor, windows: int, seq_len: int, recorded: np.ndarray, bar) -> dict:
    """Decode the first `windows` windows token by token with a KV cache; the share of
    (token, layer) expert sets equal to the recorded (windowed forward) ones."""
    from transformers import DynamicCache

    L = len(model.model.layers)
    same = total = 0
    for w in range(windows):
        x = ids[w * seq_len:(w + 1) * seq_len].view(1, -1)
        if x.shape[1] < seq_len:
            break
        sink = [[] for _ in range(L)]
        hs = gate_hooks(model, sink)
        try:
            cache = DynamicCache(config=model.config)
            for t in range(x.shape[1]):
                model(input_ids=x[:, t:t + 1], past_key_values=cache, use_cache=True)
                bar.update()
        finally:
            for h in hs:
                h.remove()
        for l in range(L):
            got = torch.cat(sink[l]).sort(-1).values.numpy()
            want = np.sort(recorded[l, w * seq_len:(w + 1) * seq_len], -1)
            same += int((got == want).all(-1).sum())
            total += got.shape[0]
    return {"windows": windows, "token_layer_sets": total, "equal": same, "share_equal": same / total if total else None}


def section_trace(args, out: Path) -> dict:
    from hi_na_moe.tools.profile_router import profile_router

    res = {}
    for path in args.model:
        model, tok = load(path)
        ids = token_ids(tok, args.data)
        if ids.numel() < args.tokens:
            fail(f"--data {args.data} has {ids.numel()} tokens, fewer than --tokens {args.tokens}")
        t0 = time.perf_counter()
        # one cheap policy: the curves are section cache's, this only records
        prof = profile_router(model, None, ids, tokens=args.tokens, seq_len=args.seq_len, batch_size=8,
                              policies=("lru",), fractions=(0.5,), progress=True)
        idx = np.stack([i.numpy() for i in prof.indices])  # [layers, tokens, k], blocks in execution order
        layers = [b["layer"] for b in prof.blocks]
        if layers != list(range(len(model.model.layers))):
            fail(f"{path}: the recorder's blocks sit in decoder layers {layers}, not one per layer in order")
        bar = tqdm(total=args.decode_check * args.seq_len, desc=f"decode check {path.name}", unit="tok", leave=False)
        check = decode_check(model, ids, args.decode_check, args.seq_len, idx, bar)
        bar.close()
        dest = trace_path(out, path, args.tokens)
        np.savez_compressed(dest, top_k_index=idx.astype(np.int16), token_ids=ids[:args.tokens].numpy().astype(np.int32),
                            seq_len=np.int32(args.seq_len), num_experts=np.int32(model.config.num_experts))
        cfg = model.config
        res[path.name] = {
            "model": rel(path), "file": rel(dest),
            "layers": idx.shape[0], "tokens": idx.shape[1], "top_k": idx.shape[2],
            "num_experts": int(cfg.num_experts), "seq_len": args.seq_len, "data": rel(args.data),
            "recorded_from": prof.blocks[0]["recorded_from"], "seconds": round(time.perf_counter() - t0, 1),
            "decode_check": check,
        }
        print(f"trace {path.name}: {idx.shape[1]} tokens x {idx.shape[0]} layers x top-{idx.shape[2]} -> {dest}; "
              f"decode check: {check['equal']}/{check['token_layer_sets']} (token, layer) sets equal", flush=True)
        del model
    return res


# ------------------------------------------------------------------------------------- cache
def read_trace(path: Path):
    if not path.is_file():
        fail(f"{path}: no trace (run --sections trace first)")
    z = np.load(path)
    return z["top_k_index"].astype(np.int64), int(z["seq_len"]), int(z["num_experts"])


def section_cache(args, out: Path) -> dict:
    from hi_na_moe.core import cache_policy as cp

    half_lives = [h for h in args.half_lives if h != args.half_life]
    res = {}
    for path in args.model:
        idx, seq_len, E = read_trace(trace_path(out, path, args.tokens))
        L, T, k = idx.shape
        total = L * E
        trace = cp.make_trace(idx)
        sizes = [max(cp.min_capacity(trace), int(round(f * total))) for f in FRACTIONS]
        names = list(ONLINE) + ["belady"]
        runs = len(sizes) * (len(names) + len(half_lives))
        bar = tqdm(total=runs, desc=f"cache replay {path.name}", unit="run", leave=False)
        step = lambda *_: bar.update()  # noqa: E731
        t0 = time.perf_counter()
        curve = cp.hit_rate_curve(trace, sizes, names, options={"freq-decay": {"half_life": args.half_life}},
                                  progress=step)
        rates = {n: [r.hit_rate for r in row] for n, row in curve.items()}
        sweep = {}
        for h in half_lives:
            row = cp.hit_rate_curve(trace, sizes, ["freq-decay"], options={"freq-decay": {"half_life": h}},
                                    progress=step)["freq-decay"]
            sweep[f"freq-decay/half-life={h:g}"] = [r.hit_rate for r in row]
        bar.close()
        mins = rates["belady"]
        per_size = []
        for i, (c, f) in enumerate(zip(sizes, FRACTIONS)):
            ratio = {n: rates[n][i] / mins[i] for n in ONLINE}
            best = max(ONLINE, key=lambda n: ratio[n])
            per_size.append({"fraction": f, "slots": c, "min_hit_rate": mins[i], "best": best,
                             "best_hit_rate": rates[best][i], "best_ratio_to_min": ratio[best],
                             "ratio_to_min": ratio,
                             "sweep_ratio_to_min": {n: v[i] / mins[i] for n, v in sweep.items()}})
        worst = {n: min(p["ratio_to_min"][n] for p in per_size) for n in ONLINE}
        ship = max(ONLINE, key=lambda n: worst[n])
        short = [{"fraction": p["fraction"], "slots": p["slots"], "ratio_to_min": p["ratio_to_min"][ship],
                  "points_short_of_target": 100 * (TARGET_OF_MIN - p["ratio_to_min"][ship])}
                 for p in per_size if p["ratio_to_min"][ship] < TARGET_OF_MIN]
        res[path.name] = {
            "trace": str(trace_path(out, path, args.tokens).name), "layers": L, "tokens": T, "top_k": k,
            "num_experts": E, "total_experts": total, "accesses": trace.accesses, "steps": len(trace.steps),
            "distinct_keys_used": len(trace.keys()),
            "order": "tokens in text order; within a token its layers in order; a step = one layer's k experts",
            "pool": "one pool of slots for every layer's experts, key (layer, expert); a step's experts resident "
                    "together",
            "freq_decay_half_life_tokens": args.half_life,
            "sizes": sizes, "fractions": list(FRACTIONS), "hit_rate": rates, "freq_decay_sweep": sweep,
            "per_size": per_size,
            "worst_ratio_to_min": worst,
            "ship": ship,
            "ship_rule": "the online policy whose smallest ratio to MIN over the sizes is largest",
            "ship_short_of_target": short,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(f"cache {path.name}: ship {ship} (worst ratio to MIN {100 * worst[ship]:.1f} %); "
              + ", ".join(f"{100 * p['fraction']:.0f} %: {p['best']} {100 * p['best_ratio_to_min']:.1f}"
                          for p in per_size), flush=True)
    return res


# ------------------------------------------------------------------------------------- predict
@torch.no_grad()
def section_predict(args, out: Path) -> dict:
    path = args.predict_model
    model, tok = load(path)
    ids = token_ids(tok, args.data)
    n_win = ids.numel() // args.seq_len if args.predict_tokens is None else args.predict_tokens // args.seq_len
    n_win = min(n_win, ids.numel() // args.seq_len)
    if n_win < 1:
        fail(f"--data {args.data}: fewer tokens than one window of {args.seq_len}")
    windows = ids[: n_win * args.seq_len].view(n_win, args.seq_len)
    layers = model.model.layers
    L = len(layers)
    E, k = int(model.config.num_experts), int(model.config.num_experts_per_tok)
    extra = [m for m in EXTRA if k + m <= E]  # a predicted set no larger than the layer's experts
    M = max(extra)
    cap: dict = {}
    hs = []
    for l, layer in enumerate(layers):
        hs.append(layer.post_attention_layernorm.register_forward_hook(
            lambda m, a, o, l=l: cap.update({("x", l): o.detach(), ("mid", l): a[0].detach()}) and None))
        hs.append(layer.register_forward_hook(
            lambda m, a, o, l=l: cap.__setitem__(("out", l), (o[0] if isinstance(o, tuple) else o).detach())))
        hs.append(layer.mlp.gate.register_forward_hook(
            lambda m, a, o, l=l: cap.__setitem__(("idx", l), o[2].detach())))

    def ranked(target: int, h: torch.Tensor) -> torch.Tensor:
        """Layer `target`'s router on h ([rows, hidden]) as OlmoeTopKRouter computes it: the
        softmax of its gate linear, experts by falling probability (the top k+M)."""
        g = layers[target].mlp.gate
        probs = F.softmax(F.linear(h.reshape(-1, g.hidden_dim), g.weight), dtype=torch.float, dim=-1)
        return torch.topk(probs, min(k + M, E), dim=-1).indices

    def overlap(pred: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
        return (pred.unsqueeze(-1) == actual.unsqueeze(-2)).any(-1).sum(-1)

    variants = VARIANTS
    hits = {(v, l, j, m): 0 for v in variants for l in range(L) for j in range(1, L - l) for m in extra}
    self_agree = [0] * L
    use = torch.zeros(L, E, dtype=torch.float64)
    rows = 0
    bar = tqdm(total=n_win, desc=f"predict {path.name}", unit="window", leave=False)
    try:
        for i in range(0, n_win, 8):
            x = windows[i:i + 8]
            cap.clear()
            model(input_ids=x, use_cache=False)
            # a snapshot: calling a norm below runs its capture hook again, overwriting cap
            got = dict(cap)
            actual = [got[("idx", l)] for l in range(L)]
            n = actual[0].shape[0]
            for l in range(L):
                own = ranked(l, got[("x", l)])[:, :k]
                self_agree[l] += int((own.sort(-1).values == actual[l].sort(-1).values).all(-1).sum())
                use[l] += torch.bincount(actual[l].reshape(-1), minlength=E).double()
                for j in range(1, L - l):
                    t = l + j
                    srcs = {"moe_input": got[("x", l)],
                            "mid_target": layers[t].post_attention_layernorm(got[("mid", l)]),
                            "residual": layers[t].post_attention_layernorm(got[("out", l)])}
                    for v, h in srcs.items():
                        order = ranked(t, h)
                        for m in extra:
                            hits[(v, l, j, m)] += int(overlap(order[:, :k + m], actual[t]).sum())
            rows += n
            bar.update(x.shape[0])
    finally:
        bar.close()
        for h in hs:
            h.remove()
    table = []
    for (v, l, j, m), h in hits.items():
        table.append({"variant": v, "layer": l, "distance": j, "target_layer": l + j, "extra": m,
                      "predicted": k + m, "recall": h / (rows * k), "precision": h / (rows * (k + m))})
    static = []
    for t in range(1, L):
        order = torch.argsort(-use[t], stable=True)
        share = use[t] / use[t].sum() * k  # per expert: the share of tokens routing to it
        for m in extra:
            got = float(share[order[:k + m]].sum())  # = hits / tokens for a fixed prediction
            static.append({"target_layer": t, "extra": m, "recall": got / k, "precision": got / (k + m)})
    # which variant and extra m first reach the recall target, per (layer, distance)
    reach = []
    for l in range(L):
        for j in range(1, L - l):
            row = {"layer": l, "distance": j, "target_layer": l + j}
            for v in variants:
                ok = [m for m in extra if hits[(v, l, j, m)] / (rows * k) >= RECALL_TARGET]
                row[v] = min(ok) if ok else None
            reach.append(row)
    res = {
        "model": rel(path), "data": rel(args.data), "tokens": rows, "windows": n_win, "seq_len": args.seq_len, "layers": L,
        "num_experts": E, "top_k": k, "extra": extra,
        "router": "OlmoeTopKRouter as transformers computes it: softmax(gate linear) in float32, top-(k+m)",
        "variants": {
            "moe_input": "layer (l+j)'s router on x[l] = post_attention_layernorm[l](h_mid[l]), layer l's MoE "
                         "input (what layer l's own router sees); known when layer l routes",
            "mid_target": "layer (l+j)'s router on post_attention_layernorm[l+j](h_mid[l]), layer l's MoE input "
                          "normalised with the target layer's norm weights; known when layer l routes",
            "residual": "layer (l+j)'s router on post_attention_layernorm[l+j](h_in[l+1]), the residual stream "
                        "before layer l+1's attention (layer l's output); known when layer l is done",
        },
        "metric": "recall = |pred & actual| / k, precision = |pred & actual| / (k+m), over all tokens",
        "self_check_share_equal": [a / rows for a in self_agree],
        "table": table,
        "static_in_sample": static,
        "random_recall": {str(m): (k + m) / E for m in extra},
        "recall_target": RECALL_TARGET,
        "smallest_extra_reaching_target": reach,
    }
    print(f"predict {path.name}: {rows} tokens; self-check {[round(a / rows, 4) for a in self_agree]}", flush=True)
    for r in reach:
        print(f"  L{r['layer']} -> L{r['target_layer']} (j={r['distance']}): smallest m reaching "
              f"{100 * RECALL_TARGET:.0f} % recall: " + ", ".join(f"{v} {r[v]}" for v in variants), flush=True)
    return res


# ------------------------------------------------------------------------------------- plots
def plot_cache(res: dict, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res)
    fig, axes = plt.subplots(2, len(names), figsize=(6.2 * len(names), 8.5), dpi=110, squeeze=False)
    for c, name in enumerate(names):
        r = res[name]
        x = 100 * np.asarray(r["fractions"])
        ax, bx = axes[0][c], axes[1][c]
        for p in list(ONLINE) + ["belady"]:
            style = dict(color="black", linestyle="--", linewidth=2) if p == "belady" else {}
            label = "Belady MIN" if p == "belady" else (
                f"freq-decay (half-life {r['freq_decay_half_life_tokens']:g})" if p == "freq-decay" else p)
            ax.plot(x, 100 * np.asarray(r["hit_rate"][p]), marker="o", markersize=3, label=label, **style)
            if p != "belady":
                bx.plot(x, [100 * s["ratio_to_min"][p] for s in r["per_size"]], marker="o", markersize=3, label=label)
        for n in r["freq_decay_sweep"]:
            bx.plot(x, [100 * s["sweep_ratio_to_min"][n] for s in r["per_size"]], linestyle=":", linewidth=1,
                    label=n.replace("freq-decay/", "freq-decay ") + " (in-sample)")
        bx.axhline(100 * TARGET_OF_MIN, color="red", linewidth=0.8, label="target: 90 % of MIN")
        ax.set_title(f"{name}: {r['layers']} layers x {r['num_experts']} experts, top-{r['top_k']}, "
                     f"{r['tokens']} tokens\none pool for all layers; hit rate against size")
        ax.set_ylabel("hit rate, % of expert accesses")
        bx.set_ylabel("hit rate, % of Belady MIN's")
        bx.set_title("as a share of MIN's hit rate")
        for a in (ax, bx):
            a.set_xlabel(f"cache size, % of all {r['total_experts']} experts")
            a.grid(alpha=0.3)
            a.set_xlim(5, 95)
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8, loc="lower right")
        bx.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(dest)
    plt.close(fig)


def plot_predict(res: dict, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = res["top_k"]
    variants = [v for v in VARIANTS if v in res["variants"]]
    fig, axes = plt.subplots(2, len(variants), figsize=(6 * len(variants), 9), dpi=110, sharey="row")
    pairs = sorted({(r["layer"], r["distance"]) for r in res["table"]}, key=lambda p: (p[1], p[0]))
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green"}
    marks = {0: "o", 1: "s", 2: "^"}
    for c, v in enumerate(variants):
        for (l, j) in pairs:
            rows = [r for r in res["table"] if r["variant"] == v and r["layer"] == l and r["distance"] == j]
            xs = [r["predicted"] for r in rows]
            for row_i, key in enumerate(("recall", "precision")):
                axes[row_i][c].plot(xs, [100 * r[key] for r in rows], marker=marks.get(l, "o"), color=colors.get(j),
                                    label=f"L{l} -> L{l + j} (j={j})")
        for row_i, key in enumerate(("recall", "precision")):
            a = axes[row_i][c]
            a.set_xlabel(f"experts predicted (k + m, k = {k})")
            a.set_ylabel(f"{key}, %")
            a.set_xticks([k + m for m in res["extra"]])
            a.grid(alpha=0.3)
            a.set_title(f"{v}: {key}")
            if key == "recall":
                a.axhline(100 * RECALL_TARGET, color="red", linewidth=0.8)
                rnd = [100 * res["random_recall"][str(m)] for m in res["extra"]]
                a.plot([k + m for m in res["extra"]], rnd, color="grey", linestyle=":", label="random")
            a.legend(fontsize=7)
    fig.suptitle(f"{Path(res['model']).name}: layer l+j's router on layer l's state, {res['tokens']} tokens")
    fig.tight_layout()
    fig.savefig(dest)
    plt.close(fig)


# ------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, action="append",
                    help="model dir (repeat); default models/hina-moe-e64 and models/hina-tiny-moe")
    ap.add_argument("--predict-model", type=Path, default=REPO / "models" / "hina-moe-e64")
    ap.add_argument("--data", type=Path, default=REPO / "data" / "heldout.txt")
    ap.add_argument("--tokens", type=int, default=8192, help="trace length (the text's first tokens)")
    ap.add_argument("--predict-tokens", type=int, default=None, help="prediction: tokens (default: every full window)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--decode-check", type=int, default=2, help="windows decoded token by token against the trace")
    ap.add_argument("--half-life", type=float, default=32.0, help="freq-decay's half-life in tokens (as profile-router)")
    ap.add_argument("--half-lives", default="8,128,512", help="freq-decay half-lives also replayed (in-sample)")
    ap.add_argument("--sections", default="trace,cache,predict")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "expert-cache")
    args = ap.parse_args()
    args.model = args.model or [REPO / "models" / "hina-moe-e64", REPO / "models" / "hina-tiny-moe"]
    args.half_lives = [float(h) for h in args.half_lives.split(",") if h.strip()]
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in ("trace", "cache", "predict")]
    if bad:
        fail(f"--sections: unknown {bad}; known: trace, cache, predict")
    for name in ("tokens", "seq_len"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = record.commit()
    stamp = f"{time.strftime('%Y-%m-%d', time.gmtime())}-{commit.split('+')[0]}"
    meta = {"tool": "study_expert_cache.py", "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "cpu_model": record.cpu_model(), "threads": args.threads, "torch": torch.__version__,
            "argv": sys.argv[1:]}
    if "trace" in sections:
        res = section_trace(args, args.out)
        (args.out / f"traces-{stamp}.json").write_text(json.dumps({**meta, "traces": res}, indent=1) + "\n")
    if "cache" in sections:
        res = section_cache(args, args.out)
        (args.out / f"cache-{stamp}.json").write_text(json.dumps({**meta, "cache": res}, indent=1) + "\n")
        plot_cache(res, args.out / f"cache-{stamp}.png")
    if "predict" in sections:
        res = section_predict(args, args.out)
        name = args.predict_model.name
        (args.out / f"predict-{name}-{stamp}.json").write_text(json.dumps({**meta, "predict": res}, indent=1) + "\n")
        plot_predict(res, args.out / f"predict-{name}-{stamp}.png")
    print(f"wrote under {args.out} ({stamp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
