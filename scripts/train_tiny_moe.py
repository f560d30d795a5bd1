#!/usr/bin/env python3
"""Train hina-tiny-moe from scratch: corpus -> tokenizer -> OLMoE model -> evaluation -> model dir.

Everything is derived from the local CPython 3.11 standard library (see scripts/build_corpus.py);
no network access is needed. Deterministically seeded; the defaults reproduce the shipped model
in models/hina-tiny-moe/ (21.5 minutes wall clock, 16 CPU-minutes, on a shared 2-core
x86-64 machine; see the model card).

    python scripts/train_tiny_moe.py                      # writes models/hina-tiny-moe and data/
    python scripts/train_tiny_moe.py --steps 20 --out /tmp/smoke --data-dir /tmp/smoke-data

Outputs:
  <out>/model.safetensors, config.json, generation_config.json      (OlmoeForCausalLM, fp32)
  <out>/tokenizer.json, tokenizer_config.json                        (byte-level BPE)
  <out>/training_stats.json                                          (all measured numbers)
  <out>/README.md                                                    (model card, rendered from the stats)
  <data-dir>/heldout.txt, corpus_manifest.json, train_unigram_counts.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

# The machine this runs on may be shared: with OpenMP threads spin-waiting, two busy processes
# on two cores slow each other down several-fold. Passive waiting changes no numerics.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EOS, PAD = "<|endoftext|>", "<|pad|>"

# The held-out slice that tests/test_shipped_model.py evaluates: the first TEST_CHUNKS
# non-overlapping windows of SEQ_LEN tokens of data/heldout.txt.
TEST_CHUNKS = 16


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "models" / "hina-tiny-moe")
    ap.add_argument("--data-dir", type=Path, default=REPO / "data")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=128, help="per-expert FFN width")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--aux-coef", type=float, default=0.01, help="router_aux_loss_coef")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--experts-impl", default="grouped_mm", choices=["grouped_mm", "eager"])
    return ap.parse_args()


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # Like training, where every document is preceded by <|endoftext|>, prompts get it as BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, tok.token_to_id(EOS))])
    return tok


def save_tokenizer(tok, out: Path, max_len: int):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                 model_max_length=max_len)
    hf.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # Class name understood by both transformers 4.x and 5.x AutoTokenizer.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


# --------------------------------------------------------------------------- evaluation
def chunks_of(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = len(ids) // seq_len
    return ids[: n * seq_len].view(n, seq_len)


def unigram_logprobs(counts: torch.Tensor) -> torch.Tensor:
    """Add-one smoothed unigram log-probabilities over the full vocabulary."""
    c = counts.double() + 1.0
    return (c / c.sum()).log()


@torch.no_grad()
def perplexities(model, chunks: torch.Tensor, uni_lp: torch.Tensor, batch: int = 16) -> dict:
    """Model and unigram perplexity over the same predicted tokens (positions 1..T-1 of each chunk)."""
    model.eval()
    nll, n = 0.0, 0
    for i in range(0, len(chunks), batch):
        x = chunks[i:i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        nll += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                               reduction="sum").item()
        n += x[:, 1:].numel()
    uni_nll = -uni_lp[chunks[:, 1:].reshape(-1)].sum().item()
    return {"tokens_predicted": n, "model_nll_per_token": nll / n, "model_ppl": math.exp(nll / n),
            "unigram_ppl": math.exp(uni_nll / n), "ppl_ratio": math.exp(nll / n) / math.exp(uni_nll / n)}


def entropy_bits(p: torch.Tensor) -> float:
    p = p.double() / p.sum()
    p = p[p > 0]
    return float(-(p * p.log2()).sum())


@torch.no_grad()
def routing_stats(model, chunks: torch.Tensor, tok, batch: int = 16) -> dict:
    """Routing statistics of every layer on the given chunks (model in eval mode).

    Notation for decoder layer l (OLMoE pre-norm block):
      h_in[l]  = hidden state entering layer l (residual stream),
      h_mid[l] = h_in[l] + attention(input_layernorm(h_in[l]))   (residual after attention),
      x[l]     = post_attention_layernorm[l](h_mid[l])            (the MoE input, fed to router l),
      router_l(v) = top-k of (v @ gate_l.weight.T); experts[l] = router_l(x[l]).
    """
    model.eval()
    cfg = model.config
    L, E, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    layers = model.model.layers
    cap = {}
    hooks = []
    for l, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, kw, l=l: cap.__setitem__(("in", l), (a[0] if a else kw["hidden_states"])),
            with_kwargs=True))
        def norm_hook(m, a, o, l=l):  # must return None (a value would replace the output)
            cap[("mid", l)], cap[("x", l)] = a[0], o

        hooks.append(layer.post_attention_layernorm.register_forward_hook(norm_hook))
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda m, a, o, l=l: cap.__setitem__(("route", l), o)))

    def topk(v, l):
        return torch.topk(v.reshape(-1, v.size(-1)) @ layers[l].mlp.gate.weight.T, k, dim=-1).indices

    def overlap(a, b):  # |a ∩ b| per row, for index sets of shape (N, k)
        return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1).double()

    # the variants read a copy of the batch's captures: calling a layer's norm below runs its hook,
    # which overwrites that layer's ("mid", "x") (before 2026-12-07 they read cap, so columns A and B
    # of layers >= 1 measured other inputs than they name)
    snap = {}
    variants = {
        "moe_input_l": lambda l: snap[("x", l)],
        "mid_l_norm_next": lambda l: layers[l + 1].post_attention_layernorm(snap[("mid", l)]),
        "in_l_norm_next": lambda l: layers[l + 1].post_attention_layernorm(snap[("in", l)]),
        "in_next_norm_next": lambda l: layers[l + 1].post_attention_layernorm(snap[("in", l + 1)]),
    }
    load = torch.zeros(L, E, dtype=torch.float64)
    tok_router_H = torch.zeros(L, dtype=torch.float64)
    reuse = torch.zeros(L, dtype=torch.float64)
    n_pairs = 0
    pred_hits = {v: torch.zeros(max(L - 1, 1), dtype=torch.float64) for v in variants}
    n_tok = 0
    V = cfg.vocab_size
    tok_expert = torch.zeros(L, V, E, dtype=torch.float64)  # counts token id -> chosen expert
    try:
        for i in range(0, len(chunks), batch):
            x = chunks[i:i + batch]
            B, T = x.shape
            cap.clear()
            model(input_ids=x)
            snap.clear()
            snap.update(cap)
            ids_flat = x.reshape(-1)
            sel = [cap[("route", l)][2] for l in range(L)]  # (B*T, k)
            for l in range(L):
                s = sel[l]
                load[l] += torch.bincount(s.reshape(-1), minlength=E).double()
                probs = torch.softmax(cap[("route", l)][0].double(), -1)
                tok_router_H[l] += float(-(probs * probs.clamp_min(1e-30).log2()).sum())
                s3 = s.view(B, T, k)
                reuse[l] += overlap(s3[:, 1:].reshape(-1, k), s3[:, :-1].reshape(-1, k)).sum() / k
                tok_expert[l].index_put_((ids_flat.repeat_interleave(k), s.reshape(-1)),
                                         torch.ones(B * T * k, dtype=torch.float64), accumulate=True)
                if l + 1 < L:
                    for name, fn in variants.items():
                        pred = topk(fn(l), l + 1)
                        pred_hits[name][l] += overlap(pred, sel[l + 1]).sum() / k
            n_tok += B * T
            n_pairs += B * (T - 1)
    finally:
        for h in hooks:
            h.remove()

    q = load / n_tok  # q[l, e] = share of tokens whose top-k contains e
    out = {
        "tokens": n_tok, "num_experts": E, "top_k": k, "uniform_entropy_bits": math.log2(E),
        "layers": [],
        "cross_layer_definitions": {
            "moe_input_l": "router of layer l+1 applied to x[l] = post_attention_layernorm[l](h_mid[l]), "
                           "the exact tensor layer l's own router sees",
            "mid_l_norm_next": "router of layer l+1 applied to post_attention_layernorm[l+1](h_mid[l])",
            "in_l_norm_next": "router of layer l+1 applied to post_attention_layernorm[l+1](h_in[l]), "
                              "the hidden state entering layer l",
            "in_next_norm_next": "router of layer l+1 applied to post_attention_layernorm[l+1](h_in[l+1]) "
                                 "(layer l's output; skips only layer l+1's attention)",
            "recall": "|predicted top-k ∩ actual top-k of layer l+1| / k, averaged over tokens",
            "random_baseline": "k/E (a uniformly random k-subset)",
            "static_baseline": "always predict the k experts most often chosen by layer l+1 on this data",
        },
    }
    for l in range(L):
        ql = q[l]
        te = tok_expert[l]
        # I(expert slot; token id), from the joint counts of (token id, chosen expert)
        pj = te / te.sum()
        pt = pj.sum(1, keepdim=True)
        pe = pj.sum(0, keepdim=True)
        nz = pj > 0
        mi = float((pj[nz] * (pj[nz] / (pt @ pe)[nz]).log2()).sum())
        row = {
            "layer": l,
            "load_share": [round(float(v), 5) for v in (load[l] / load[l].sum())],
            "load_entropy_bits": entropy_bits(load[l]),
            "max_over_min_load": float(load[l].max() / load[l].min().clamp_min(1)),
            "mean_router_entropy_bits": float(tok_router_H[l] / n_tok),
            "consecutive_reuse": float(reuse[l] / n_pairs),
            "consecutive_reuse_random_uniform": k / E,
            "consecutive_reuse_random_marginal": float((ql ** 2).sum() / k),
            "mutual_info_expert_token_bits": mi,
        }
        if l + 1 < L:
            qn = q[l + 1]
            row["next_layer_prediction_recall"] = {name: float(pred_hits[name][l] / n_tok)
                                                   for name in variants}
            row["next_layer_prediction_random_baseline"] = k / E
            row["next_layer_prediction_static_baseline"] = float(torch.topk(qn, k).values.sum() / k)
        # most over-represented frequent tokens per expert (lift), for the model card
        tot = te.sum(1)
        frequent = tot >= 20
        lift = (te / te.sum(0, keepdim=True)) / (tot / tot.sum()).unsqueeze(1)
        lift[~frequent] = 0
        row["top_tokens_by_lift"] = {
            str(e): [tok.decode([int(t)]) for t in torch.topk(lift[:, e], 6).indices] for e in range(E)}
        out["layers"].append(row)
    return out


# --------------------------------------------------------------------------- training
def batches(ids: torch.Tensor, seq_len: int, bs: int, gen: torch.Generator):
    """Endless stream of (bs, seq_len) batches; each epoch starts at a random offset, shuffled."""
    epoch = 0
    while True:
        off = int(torch.randint(0, seq_len, (1,), generator=gen))
        ch = chunks_of(ids[off:], seq_len)
        perm = torch.randperm(len(ch), generator=gen)
        for i in range(0, len(perm) - bs + 1, bs):
            yield epoch, ch[perm[i:i + bs]]
        epoch += 1


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def main():
    args = parse_args()
    t_start, c_start = time.perf_counter(), time.process_time()
    timings, cpu_timings = {}, {}
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    from tqdm import tqdm
    import transformers
    from transformers import GenerationConfig, OlmoeConfig, OlmoeForCausalLM

    transformers.logging.set_verbosity_error()

    # 1. corpus
    t, c = time.perf_counter(), time.process_time()
    args.data_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus.build(write=False)
    old_manifest = args.data_dir / "corpus_manifest.json"
    if old_manifest.is_file():
        old = json.loads(old_manifest.read_text(encoding="utf-8"))
        for key in ("train_sha256", "heldout_sha256"):
            if old.get(key) != corpus["manifest"][key]:
                print(f"WARNING: corpus {key} differs from {old_manifest} (built with Python "
                      f"{old.get('python_version')}, this is {corpus['manifest']['python_version']}); "
                      "the result will not match the shipped model exactly", flush=True)
    (args.data_dir / "heldout.txt").write_text(corpus["heldout_text"], encoding="utf-8")
    (args.data_dir / "corpus_manifest.json").write_text(
        json.dumps(corpus["manifest"], indent=2) + "\n", encoding="utf-8")
    timings["corpus_s"], cpu_timings["corpus_s"] = time.perf_counter() - t, time.process_time() - c
    print(f"corpus: {len(corpus['train'])} train docs ({len(corpus['train_text'])} chars), "
          f"{len(corpus['heldout'])} held-out docs ({len(corpus['heldout_text'])} chars)", flush=True)

    # 2. tokenizer
    t, c = time.perf_counter(), time.process_time()
    tok = train_tokenizer((d.text for d in corpus["train"]), args.vocab_size)
    train_ids = torch.tensor(tok.encode(corpus["train_text"], add_special_tokens=False).ids)
    heldout_ids = torch.tensor(tok.encode(corpus["heldout_text"], add_special_tokens=False).ids)
    timings["tokenizer_s"], cpu_timings["tokenizer_s"] = time.perf_counter() - t, time.process_time() - c
    V = tok.get_vocab_size()
    counts = torch.bincount(train_ids, minlength=V)
    (args.data_dir / "train_unigram_counts.json").write_text(json.dumps({
        "description": "token counts of the training split under models/hina-tiny-moe/tokenizer.json "
                       "(index = token id); add-one smoothed unigram baseline: (c+1)/(N+V)",
        "total": int(counts.sum()), "counts": counts.tolist()}) + "\n", encoding="utf-8")
    uni_lp = unigram_logprobs(counts)
    print(f"tokenizer: vocab {V}, train tokens {len(train_ids)}, held-out tokens {len(heldout_ids)}",
          flush=True)

    # 3. model
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    config = OlmoeConfig(
        vocab_size=V, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=False,
        max_position_embeddings=2 * args.seq_len, tie_word_embeddings=True,
        router_aux_loss_coef=args.aux_coef, output_router_logits=False,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    torch.manual_seed(args.seed)
    model = OlmoeForCausalLM(config)
    model.set_experts_implementation(args.experts_impl)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    stream = batches(train_ids, args.seq_len, args.batch_size, gen)
    heldout_chunks = chunks_of(heldout_ids, args.seq_len)
    test_chunks = heldout_chunks[:TEST_CHUNKS]

    # 4. train
    t, c = time.perf_counter(), time.process_time()
    log, evals = [], []
    lm_ema = None
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True, mininterval=2.0)
    epoch = 0
    for step in bar:
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        epoch, x = next(stream)
        out = model(input_ids=x, labels=x, output_router_logits=True)
        out.loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = float(out.aux_loss.detach())
        lm = float(out.loss) - args.aux_coef * aux
        lm_ema = lm if lm_ema is None else 0.95 * lm_ema + 0.05 * lm
        bar.set_postfix(loss=f"{lm_ema:.3f}", aux=f"{aux:.3f}", ep=epoch)
        if step % 10 == 0 or step == args.steps - 1:
            log.append({"step": step, "lm_loss": round(lm, 4), "aux_loss": round(aux, 4),
                        "grad_norm": round(float(gnorm), 4), "lr": lr_at(step, args), "epoch": epoch})
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            ev = perplexities(model, test_chunks, uni_lp)
            evals.append({"step": step + 1, "test_slice_ppl": round(ev["model_ppl"], 3)})
            bar.write(f"step {step + 1}: train loss {lm_ema:.3f}, held-out slice ppl {ev['model_ppl']:.2f}")
    bar.close()
    timings["train_s"], cpu_timings["train_s"] = time.perf_counter() - t, time.process_time() - c
    train_tokens = args.steps * args.batch_size * args.seq_len

    # 5. evaluate
    t, c = time.perf_counter(), time.process_time()
    model.eval()
    ppl_full = perplexities(model, heldout_chunks, uni_lp)
    ppl_test = perplexities(model, test_chunks, uni_lp)
    routing_full = routing_stats(model, heldout_chunks, tok)
    routing_test = routing_stats(model, test_chunks, tok)
    samples = []
    from transformers import PreTrainedTokenizerFast
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD)
    for prompt in ["The function returns", "Return a list of", "This module provides",
                   "If the file does not exist,", "Raise ValueError if"]:
        enc = hf_tok(prompt, return_tensors="pt")
        with torch.no_grad():
            g = model.generate(**enc, max_new_tokens=40, do_sample=False, eos_token_id=eos_id,
                               pad_token_id=pad_id)
        samples.append({"prompt": prompt,
                        "completion": hf_tok.decode(g[0, enc.input_ids.shape[1]:], skip_special_tokens=True)})
    timings["eval_s"], cpu_timings["eval_s"] = time.perf_counter() - t, time.process_time() - c

    # 6. save
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id,
                                               pad_token_id=pad_id, do_sample=False, max_new_tokens=64)
    model.save_pretrained(args.out, safe_serialization=True)
    save_tokenizer(tok, args.out, 2 * args.seq_len)
    weights = args.out / "model.safetensors"
    timings["total_s"], cpu_timings["total_s"] = time.perf_counter() - t_start, time.process_time() - c_start
    load_avg = os.getloadavg() if hasattr(os, "getloadavg") else None

    stats = {
        "model": args.out.name,  # "hina-tiny-moe" for the default --out
        "architecture": "OlmoeForCausalLM",
        "parameters": n_params,
        "active_parameters_per_token": n_params - sum(
            lay.mlp.experts.gate_up_proj.numel() + lay.mlp.experts.down_proj.numel()
            for lay in model.model.layers) * (args.experts - args.top_k) // args.experts,
        "weights_bytes": weights.stat().st_size,
        "weights_dtype": "float32",
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                            if k not in ("out", "data_dir")},
        "train_tokens_available": len(train_ids),
        "train_tokens_seen": train_tokens,
        "epochs": train_tokens / len(train_ids),
        "heldout_tokens": len(heldout_ids),
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "cpu_timings_s": {k: round(v, 1) for k, v in cpu_timings.items()},
        "load_average_at_end": load_avg,
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": __import__("tokenizers").__version__,
            "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": args.threads,
        },
        "corpus": {k: v for k, v in corpus["manifest"].items() if k != "heldout_files"},
        "heldout_full": ppl_full,
        "test_slice": {"chunks": TEST_CHUNKS, "seq_len": args.seq_len, **ppl_test,
                       "load_entropy_bits": [r["load_entropy_bits"] for r in routing_test["layers"]],
                       "mean_router_entropy_bits": [r["mean_router_entropy_bits"]
                                                    for r in routing_test["layers"]]},
        "routing_heldout": routing_full,
        "heldout_slice_ppl_during_training": evals,
        "train_log": log,
        "samples_greedy": samples,
    }
    (args.out / "training_stats.json").write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
    (args.out / "README.md").write_text(render_card(stats), encoding="utf-8")
    print(json.dumps({"timings_s": stats["timings_s"], "cpu_timings_s": stats["cpu_timings_s"],
                      "heldout": ppl_full,
                      "weights_bytes": stats["weights_bytes"]}, indent=2))


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --------------------------------------------------------------------------- model card
def render_card(s: dict) -> str:
    h = s["hyperparameters"]
    r = s["routing_heldout"]
    E, k = r["num_experts"], r["top_k"]
    full, test = s["heldout_full"], s["test_slice"]
    c = s["corpus"]
    tm = s["timings_s"]
    L = len(r["layers"])
    lines = []
    a = lines.append
    a("---\nlicense: other\nlicense_name: psf-2.0\nlibrary_name: transformers\npipeline_tag: text-generation\n"
      "tags: [olmoe, mixture-of-experts, tiny, cpu]\n---\n")
    a(f"# {s['model']}\n")
    a("A tiny Mixture-of-Experts causal language model (transformers `OlmoeForCausalLM`), trained "
      "from scratch on CPU by `scripts/train_tiny_moe.py` on the docstrings of Python's standard "
      "library. It exists so that hi_na_moe has a real, genuinely trained MoE model to test and "
      "benchmark against without any download. It writes docstring-flavoured English; it is not "
      "useful as an assistant.\n")
    a("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
      "tok = AutoTokenizer.from_pretrained(\"models/hina-tiny-moe\")\n"
      "model = AutoModelForCausalLM.from_pretrained(\"models/hina-tiny-moe\")\n"
      "ids = tok(\"The function returns\", return_tensors=\"pt\")\n"
      "print(tok.decode(model.generate(**ids, max_new_tokens=40)[0], skip_special_tokens=True))\n```\n")
    a("## Architecture and size\n")
    a(f"| | |\n|---|---|\n| class | `OlmoeForCausalLM` (`model_type: olmoe`) |\n"
      f"| layers | {h['layers']} |\n| hidden size | {h['hidden_size']} |\n"
      f"| attention heads | {h['heads']} (head dim {h['hidden_size'] // h['heads']}, no GQA, q/k RMSNorm, RoPE) |\n"
      f"| experts per layer | {E}, top-{k} routing (softmax, `norm_topk_prob=False`) |\n"
      f"| expert FFN | SwiGLU, intermediate size {h['intermediate_size']} |\n"
      f"| vocabulary | {h['vocab_size']} (byte-level BPE, `tokenizers`) |\n"
      f"| embeddings | tied input/output |\n"
      f"| context | trained on {h['seq_len']}-token windows; `max_position_embeddings` {2 * h['seq_len']} |\n"
      f"| parameters | {s['parameters']:,} total, {s['active_parameters_per_token']:,} active per token |\n"
      f"| weights | `model.safetensors`, {s['weights_dtype']}, {s['weights_bytes']:,} bytes |\n")
    a("Special tokens: `<|endoftext|>` (id 0) is BOS, EOS and document separator; `<|pad|>` (id 1) "
      "is padding. The tokenizer prepends `<|endoftext|>` to every input, as in training, where "
      "every document is preceded by it.\n")
    a("## Training data and licence\n")
    a(f"Docstrings of CPython {c['python_version']}'s standard library (module, class and function "
      "docstrings, found by parsing every `.py` file under `sysconfig.get_paths()['stdlib']` with "
      "`ast` — nothing is imported — in sorted path order, `site-packages` excluded, the stdlib's "
      "own test suite included) plus the help topics of `pydoc_data.topics` (the text of "
      f"`help('assignment')` etc.). Docstrings shorter than {c['min_chars']} characters and exact "
      f"duplicates are dropped. {c['documents']:,} documents from {c['files_parsed']:,} files "
      f"({c['files_unparseable']} unparseable Python-2 test data files skipped).\n")
    a(f"Split by whole file (or pydoc topic): {c['split_rule']}. Train: {c['train_documents']:,} "
      f"documents, {c['train_chars']:,} characters, {s['train_tokens_available']:,} tokens. Held out: "
      f"{c['heldout_documents']:,} documents, {c['heldout_chars']:,} characters, "
      f"{s['heldout_tokens']:,} tokens, shipped as `data/heldout.txt` (see `data/README.md`, "
      "`data/corpus_manifest.json`).\n")
    a("**Licence.** Python's software and documentation are distributed under the PSF License "
      "Agreement (PSF-2.0), see `LICENSE.txt` in the stdlib directory; the docstrings and the "
      "pydoc topics are part of that distribution. This model and the shipped held-out text are "
      "derived from it and are offered under the same terms.\n")
    a("## Training\n")
    a(f"{h['steps']} AdamW steps (β=(0.9, 0.95), weight decay {h['weight_decay']} on matrices), "
      f"batch {h['batch_size']} × {h['seq_len']} tokens, peak LR {h['lr']} with {h['warmup']} warm-up "
      f"steps and cosine decay to {h['min_lr_ratio']}× peak, gradient clipping 1.0, load-balancing "
      f"auxiliary loss (Switch-style, as in transformers) with coefficient {h['aux_coef']}, fp32, "
      f"seed {h['seed']}, `torch.use_deterministic_algorithms(True)`, {h['threads']} threads. "
      f"{s['train_tokens_seen']:,} tokens seen ({s['epochs']:.2f} epochs).\n")
    env = s["environment"]
    ct = s["cpu_timings_s"]
    la = s.get("load_average_at_end")
    a(f"Measured for the shipped run on an `{env['cpu']}` machine with {env['cpu_count']} cores, "
      f"{h['threads']} torch threads (torch {env['torch']}, transformers {env['transformers']}):\n")
    a("| phase | wall clock (s) | CPU time, all threads (s) |\n|---|---|---|")
    for key, name in (("corpus_s", "corpus extraction"), ("tokenizer_s", "tokenizer training + tokenization"),
                      ("train_s", f"training ({h['steps']} steps)"), ("eval_s", "evaluation, routing stats, samples"),
                      ("total_s", "**total**")):
        a(f"| {name} | {tm[key]} | {ct[key]} |")
    a("")
    a(f"Total wall clock {tm['total_s'] / 60:.1f} min. The machine was shared with other jobs "
      "during the run" + (f" (1/5/15-min load average at the end: {la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f})"
                          if la else "") + ", so the wall clock above includes waiting for the CPU.\n")
    a("Reproduce: `python scripts/train_tiny_moe.py` (writes this directory and `data/`). The run is "
      "seeded and deterministic for a given environment; the corpus depends on the Python version "
      f"(this one: {c['python_version']}), and the script warns when its SHA-256 differs from "
      "`data/corpus_manifest.json`.\n")
    a("## Held-out perplexity\n")
    a("Non-overlapping windows of {T} tokens over `data/heldout.txt`; every token after the first "
      "of each window is predicted. The baseline is an add-one smoothed unigram model of the "
      "training split (`data/train_unigram_counts.json`) with the same tokenizer, scored on the same "
      "tokens.\n".format(T=h["seq_len"]))
    a("| text | tokens scored | model ppl | unigram ppl | ratio |\n|---|---|---|---|---|")
    a(f"| full held-out split | {full['tokens_predicted']:,} | {full['model_ppl']:.2f} | "
      f"{full['unigram_ppl']:.1f} | {full['ppl_ratio']:.3f} |")
    a(f"| first {test['chunks']} windows (the slice `tests/test_shipped_model.py` checks) | "
      f"{test['tokens_predicted']:,} | {test['model_ppl']:.2f} | {test['unigram_ppl']:.1f} | "
      f"{test['ppl_ratio']:.3f} |\n")
    a("## Routing statistics\n")
    a(f"Computed by the training script on the {r['tokens']:,} held-out tokens (model in eval mode). "
      f"Uniform routing would have load entropy log2({E}) = {math.log2(E):.3f} bits.\n")
    a("- *load entropy*: entropy of the share of top-k assignments each expert receives.\n"
      "- *router entropy*: mean over tokens of the entropy of the router's softmax.\n"
      "- *I(expert; token)*: mutual information between the token id and a chosen expert.\n"
      "- *reuse*: share of the top-k experts of token t that were also chosen for token t-1 "
      "(same layer, same window); *random* = k/E for independent uniform choices, "
      "*marginal* = Σ_e q_e²/k for independent choices with the measured per-expert rates q_e.\n")
    a("| layer | load entropy (bits) | max/min load | router entropy (bits) | I(expert; token) (bits) "
      "| reuse | random | marginal |\n|---|---|---|---|---|---|---|---|")
    for row in r["layers"]:
        a(f"| {row['layer']} | {row['load_entropy_bits']:.3f} | {row['max_over_min_load']:.2f} | "
          f"{row['mean_router_entropy_bits']:.3f} | {row['mutual_info_expert_token_bits']:.3f} | "
          f"{row['consecutive_reuse']:.3f} | {row['consecutive_reuse_random_uniform']:.3f} | "
          f"{row['consecutive_reuse_random_marginal']:.3f} |")
    a("")
    a("**Predicting layer l+1's experts early.** Recall of layer l+1's actual top-k set when layer "
      "l+1's router (its `mlp.gate` weight) is applied to a hidden state available earlier. "
      "Notation for layer l: `h_in[l]` is the residual stream entering the layer, "
      "`h_mid[l] = h_in[l] + attn(input_layernorm(h_in[l]))`, and "
      "`x[l] = post_attention_layernorm[l](h_mid[l])` is the MoE input that layer l's own router "
      "sees. Columns:\n")
    a("- **A** `gate[l+1](x[l])` — layer l's MoE input as is (available when layer l routes);\n"
      "- **B** `gate[l+1](post_attention_layernorm[l+1](h_mid[l]))` — same point, layer l+1's norm;\n"
      "- **C** `gate[l+1](post_attention_layernorm[l+1](h_in[l]))` — the hidden state entering layer l "
      "(earliest);\n"
      "- **D** `gate[l+1](post_attention_layernorm[l+1](h_in[l+1]))` — layer l's output, skipping only "
      "layer l+1's attention (latest);\n"
      f"- baselines: random = k/E = {k / E:.3f}; static = always the k experts layer l+1 uses most.\n")
    a("| l → l+1 | A | B | C | D | random | static |\n|---|---|---|---|---|---|---|")
    for row in r["layers"][:-1]:
        p = row["next_layer_prediction_recall"]
        a(f"| {row['layer']} → {row['layer'] + 1} | {p['moe_input_l']:.3f} | {p['mid_l_norm_next']:.3f} | "
          f"{p['in_l_norm_next']:.3f} | {p['in_next_norm_next']:.3f} | "
          f"{row['next_layer_prediction_random_baseline']:.3f} | "
          f"{row['next_layer_prediction_static_baseline']:.3f} |")
    a("")
    a("Tokens most over-represented (by lift, among tokens seen ≥ 20 times) in each expert of "
      f"layer 0 and layer {L - 1} (`(byte)`: a token that is only part of a UTF-8 character):\n")
    for l in (0, L - 1):
        a(f"| layer {l} expert | tokens |\n|---|---|")
        for e, toks in r["layers"][l]["top_tokens_by_lift"].items():
            a(f"| {e} | " + " ".join(("`" + repr(t)[1:-1].replace("`", "'") + "`") if t else "(byte)"
                                     for t in toks).replace("|", "\\|") + " |")
        a("")
    a("All numbers above are in `training_stats.json` (key `routing_heldout`), with the "
      "training loss curve and timings.\n")
    a("## Greedy samples\n")
    a("`model.generate(max_new_tokens=40, do_sample=False)`; the prompt is in bold.\n")
    for smp in s["samples_greedy"]:
        text = (smp["completion"]).replace("\n", "⏎ ")
        a(f"- **{smp['prompt']}**{text}")
    a("")
    a("## Limitations\n")
    a("A few million parameters trained for minutes on a few megabytes of docstrings: it knows "
      "docstring phrasing and some Python vocabulary, not facts; outputs are often wrong or "
      "repetitive. Intended for testing and benchmarking MoE inference code, not for use.\n")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
