"""Decode of several sequences at once (a batch of B rows a step), and prefill, with scope="all".

Batched decode is what a server of a few users, or a caller of generate() with several prompts,
runs: each step multiplies every weight matrix by B rows instead of one, so the int8 / int4
kernels' row blocks (two to four rows sharing one pass over a weight panel) do B times the
arithmetic for the same dense bytes, and each MoE layer reads the union of the B rows' experts.

Loads the checkpoint with hi_na_moe.from_pretrained (--weights from the store --cache-dir) or,
with --cache-dir none, loads it with transformers and packs it in memory with enable_for_model
(for a tier or format the store does not hold, e.g. HINA_MOE_ISA=avx2). Per batch size B in
--batches and per round: a fresh DynamicCache, a B x 16-token prompt (untimed), then --steps
greedy decode steps as a loop of forwards (logits_to_keep=1, argmax), each step timed; after
each arm's steps one untimed 256 MB read on the read-bandwidth probe (BandwidthProbe, the same
threads) gives that round's bandwidth. With --prefill T1,T2,... each round also times one prefill
of each length. Every arm must decode the same tokens.

--ab-prefetch A,B,...: arms that differ only in the int8 / int4 kernels' prefetch distance for
jobs of several rows (HINA_PFM, bytes; "-" leaves it at the library's choice), switched every
round in one process. Needs the tuning build (pip install ... -Ccmake.define.HINA_PREFETCH_TUNING=ON;
the kernels read HINA_PF* at every job there, never in a release build).

--ab-decode-rows A,B,...: arms that differ only in how many rows the native decode paths take
(fastpath.common.DECODE_MAX_ROWS and the copies of it the other parts import; "-" leaves the library's),
a Python-level switch, so in a release build; a batch above an arm's limit runs the modules'
own forwards.

--against transformers: a second arm, the checkpoint loaded by transformers alone (bf16, its own
experts' code), resident beside ours and alternating with it round by round (each arm checked
against its own first run's tokens: bf16 and quantised weights decode different tokens).

--against llamacpp --gguf <file>: llama.cpp on the same weights (make_gguf.py), driven as
bench_interleaved.py drives it: `bench_llamacpp.py --serve --batched 16` in its venv, resident
beside ours, which for each batch size decodes B new prompts together through llama.cpp's batch
API (one llama_decode a step of one token a sequence, a KV cache shared by the sequences, as its
server runs concurrent requests) and reads its own paired probe after them. No prefill arm for it
here (bench_full_model.py has llama.cpp's prefill).

--count-bytes replays the same prompts and tokens through the checkpoint's own bf16 model
(transformers, loaded after ours is freed) and counts each step's distinct routed experts per
MoE layer from its routers' selections (modules returning an integer index tensor last, as
transformers 5's TopKRouter classes do); a step's bytes are then the packed dense layers
(attention, shared experts, routers, lm_head) plus that union of packed experts, and GB/s is
those bytes over the step's time. Quantised weights can route a few tokens to other experts than
bf16 does, so the union is the bf16 model's, an estimate within a few experts.

    chrt -f 1 python benchmarks/bench_batch_decode.py --ckpt /work/ckpt/qwen1.5-moe-a2.7b-4l \\
        --cache-dir /work/ckpt/hina-cache/bench_full_model-qwen1.5-moe-a2.7b-4l/int4 --count-bytes
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

from lib import record, stored


def load(args):
    import torch

    import hi_na_moe

    if args.cache_dir == "none":
        from transformers import AutoModelForCausalLM

        cfg = hi_na_moe.load_config(scope="all", dense_lossless="", cache=False)
        model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16).eval()
        hi_na_moe.enable_for_model(model, weights=args.weights, config=cfg)
        return model
    return stored.load(args.ckpt, args.weights, args.cache_dir)


def packed_bytes(model) -> tuple[int, list[float]]:
    """(bytes of the packed dense layers, per MoE block the bytes of one packed expert)."""
    import hi_na_moe

    report = hi_na_moe.report_for(model)
    if report is None or not report.blocks:
        raise SystemExit("no enable report with MoE blocks on the loaded model")
    per_expert = [b.packed_bytes / b.experts for b in report.blocks if b.experts and b.packed_bytes]
    return sum(d.packed_bytes for d in report.dense), per_expert


def decode(model, prompt, steps: int, probe, step_ms: list, tokens: list) -> float:
    """Greedy decode of `steps` tokens after `prompt` (B x P); appends step times (ms) and the
    tokens fed at each step; returns the probe's GB/s read right after."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            tokens.append(nxt)
            t = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            step_ms.append((time.perf_counter() - t) * 1e3)
    return probe.read(256 << 20)


def count_union(ckpt: str, prompts: dict, fed: dict) -> dict:
    """Per batch size: the mean over decode steps of the distinct experts the steps' rows route
    to, summed over MoE layers (the bf16 model's routers on the same prompts and tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    picked: list[torch.Tensor] = []

    def hook(_m, _inp, out):
        if isinstance(out, tuple) and out and isinstance(out[-1], torch.Tensor) and not out[-1].is_floating_point():
            picked.append(out[-1])

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith(".gate")]
    union = {}
    with torch.inference_mode():
        for b, prompt in prompts.items():
            cache = DynamicCache(config=model.config)
            model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            per_step = []
            for tok in fed[b]:
                picked.clear()
                model(tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
                if not picked:
                    raise SystemExit("no router selections seen: this family's routers do not return indices")
                per_step.append(sum(int(torch.unique(ix).numel()) for ix in picked))
            union[b] = statistics.mean(per_step)
    for h in handles:
        h.remove()
    return union


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stored.add_args(ap, cache_help="the store of --weights, or none: pack in memory")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=16, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefill", default="", help="also time prefills of these many tokens (comma-separated)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ab-prefetch", default="", help="HINA_PFM values for arms (tuning build), e.g. 1024,-")
    ap.add_argument("--ab-decode-rows", default="", help="DECODE_MAX_ROWS values for arms, e.g. 16,-")
    ap.add_argument("--against", default="", choices=("", "transformers", "llamacpp"))
    ap.add_argument("--gguf", help="llama.cpp's weights, for --against llamacpp")
    ap.add_argument("--llamacpp-python", default="/work/venv-llamacpp/bin/python")
    ap.add_argument("--count-bytes", action="store_true")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch

    from hi_na_moe import _native

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    model = load(args)
    dense_bytes, expert_bytes = packed_bytes(model)
    probe = _native.BandwidthProbe(1 << 30, args.threads)
    if sum(map(bool, (args.ab_prefetch, args.ab_decode_rows, args.against))) > 1:
        raise SystemExit("--ab-prefetch, --ab-decode-rows and --against are separate comparisons: give one")
    if args.ab_prefetch and not _native.step_trace_compiled():
        raise SystemExit("--ab-prefetch needs the tuning build (HINA_PREFETCH_TUNING=ON): a release build "
                         "fixes its prefetch distances when the library loads")

    def prefetch_rows(value: str):
        def put() -> None:
            if value == "-":
                os.environ.pop("HINA_PFM", None)
            else:
                os.environ["HINA_PFM"] = value
        return put

    from hi_na_moe.fastpath import attention, common, layers, mla, mlp, norm, routers, stack

    library_rows = common.DECODE_MAX_ROWS

    def decode_rows(value: str):
        n = library_rows if value == "-" else int(value)

        def put() -> None:  # the constant and every module's copy of it
            for mod in (common, norm, layers, stack, mlp):
                mod.DECODE_MAX_ROWS = n
            for mod in (layers, routers):
                mod.ROUTER_MAX_ROWS = n
            attention._MAX_BATCH = mla._MAX_BATCH = n
        return put

    # arm name -> (model, what to set before its runs); a llama.cpp arm has no model here
    if args.ab_prefetch:
        models = {f"prefetch {v}": (model, prefetch_rows(v)) for v in args.ab_prefetch.split(",")}
    elif args.ab_decode_rows:
        models = {f"decode rows {v if v != '-' else library_rows}": (model, decode_rows(v))
                  for v in args.ab_decode_rows.split(",")}
    else:
        models = {f"hi_na_moe {args.weights}": (model, prefetch_rows("-"))}
    ours = list(models)
    llama = None
    # the rival first, so that the last column (first arm's ms / last's) is our speed-up
    if args.against == "transformers":
        from transformers import AutoModelForCausalLM

        native = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16).eval()
        models = {"transformers bf16": (native, prefetch_rows("-")), **models}
        del native
    elif args.against == "llamacpp":
        if not args.gguf:
            raise SystemExit("--against llamacpp needs --gguf (benchmarks/make_gguf.py writes it)")
        from bench_interleaved import Llama

        llama = Llama(args.llamacpp_python, Path(args.gguf), args.threads, batched=max(batches))
        models = {f"llama.cpp {Path(args.gguf).stem}": (None, prefetch_rows("-")), **models}
    arms = list(models)

    vocab = min(model.config.vocab_size, 30000)
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(300, vocab, (b, 16), generator=gen) for b in batches}
    prefills = {int(t): torch.randint(300, vocab, (1, int(t)), generator=gen) for t in args.prefill.split(",") if t}
    steps = {b: {a: [] for a in arms} for b in batches}
    probes = {b: {a: [] for a in arms} for b in batches}
    prefill_ms = {t: {a: [] for a in arms} for t in prefills}
    fed: dict = {}  # (arm, B) -> the tokens fed at each step of its first run
    for r in range(args.rounds + 1):  # round 0 warms up and fixes each batch's tokens
        for b in batches:
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                m, put = models[arm]
                put()
                if m is None:  # llama.cpp: B prompts of its own, the steps' ms and its probe read
                    ms, gbs_list = llama.batch(b, args.steps)
                    if r:
                        steps[b][arm] += ms
                        probes[b][arm] += gbs_list
                    continue
                ms, toks = [], []
                gbs = decode(m, prompts[b], args.steps, probe, ms, toks)
                if (arm, b) not in fed:
                    fed[arm, b] = toks
                elif any(not torch.equal(x, y) for x, y in zip(toks, fed[arm, b])):
                    raise SystemExit(f"batch {b}, {arm}: other tokens than its first run's")
                if r:
                    steps[b][arm] += ms
                    probes[b][arm].append(gbs)
        for t_len, long_prompt in prefills.items():
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                m, put = models[arm]
                if m is None:
                    continue
                put()
                with torch.inference_mode():
                    t = time.perf_counter()
                    m(long_prompt, use_cache=True, logits_to_keep=1)
                    if r:
                        prefill_ms[t_len][arm].append((time.perf_counter() - t) * 1e3)
        print(f"round {r} done", flush=True)
    prefetch_rows("-")()
    decode_rows("-")()
    if llama is not None:
        llama.close()
    models.clear()  # free both before the replay loads the bf16 model
    del model, m
    gc.collect()
    union = count_union(args.ckpt, prompts, {b: fed[ours[0], b] for b in batches}) if args.count_bytes else {}
    per_expert = statistics.mean(expert_bytes)

    res = {"ckpt": args.ckpt, "weights": args.weights, "threads": args.threads, "steps": args.steps,
           "rounds": args.rounds, "isa": os.environ.get("HINA_MOE_ISA", "auto"), "arms": arms,
           "dense_packed_bytes": dense_bytes, "expert_packed_bytes": per_expert, "batches": {}}
    head = "| B | " + " | ".join(f"{a}: ms a step (tok/s)" for a in arms) + " | probe GB/s |"
    if union:
        head += f" experts read a step | GB a step | GB/s ({ours[0]}) |"
    if len(arms) > 1:
        head += " first arm's ms / last's |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for b in batches:
        med = {a: statistics.median(steps[b][a]) for a in arms}
        row = {"median_ms": med, "tok_s": {a: b / med[a] * 1e3 for a in arms},
               "probe_gbs": {a: statistics.median(probes[b][a]) for a in arms}}
        line = f"| {b} | " + " | ".join(f"{med[a]:.2f} ({b / med[a] * 1e3:.1f})" for a in arms)
        line += " | " + " / ".join(f"{row['probe_gbs'][a]:.1f}" for a in arms) + " |"
        if union:
            gb = (dense_bytes + union[b] * per_expert) / 1e9
            # the packed bytes: GB/s for our arms only
            row.update(experts_read=union[b], gb_a_step=gb,
                       gbs={a: gb / med[a] * 1e3 for a in ours})
            line += f" {union[b]:.1f} | {gb:.3f} | {gb / med[ours[0]] * 1e3:.1f} |"
        if len(arms) > 1:
            line += f" {med[arms[0]] / med[arms[-1]]:.3f}x |"
        print(line)
        res["batches"][b] = row
    res["prefill"] = {}
    for t_len in prefills:
        med = {a: statistics.median(prefill_ms[t_len][a]) for a in arms if prefill_ms[t_len][a]}
        res["prefill"][t_len] = {"median_ms": med}
        names = list(med)
        print(f"prefill-{t_len}: " + ", ".join(f"{a} {med[a]:.1f} ms" for a in names)
              + (f" ({med[names[0]] / med[names[-1]]:.3f}x)" if len(names) > 1 else ""))
    if args.json:
        at = record.host()
        recs = [record.make(a, steps[b][a], threads=args.threads, probe_gbs=probes[b][a], tool="bench_batch_decode.py",
                            at=at, model=Path(args.ckpt).name, weights=args.weights, batch=b, what="decode step")
                for b in batches for a in arms]
        record.write(args.json, res, recs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
