"""hi-na-moe command line: `check`, `bench`, `debug`, `demo`, `cache`, `profile-router`, `distill` and `serve`.

User mistakes (missing path, not an MoE model, bad config) print one line and a hint and exit
with status 2; a demo whose accelerated output disagrees with native exits with status 1.
"""

from __future__ import annotations

import argparse
import sys

from ..core.config import (
    DEFAULT_GROUP_SIZE,
    ISA_TIERS,
    WEIGHT_FORMATS,
    ConfigError,
)
from .commands.bench import cmd_bench
from .commands.cache import cmd_cache_clear, cmd_cache_list
from .commands.check import cmd_check
from .commands.common import UserError, shipped_model_dir
from .commands.debug import cmd_debug
from .commands.demo import cmd_demo
from .commands.distill import cmd_distill
from .commands.profile import cmd_profile_router
from .commands.serve import add_parser as add_serve_parser

__all__ = ["UserError", "build_parser", "main", "shipped_model_dir"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hi-na-moe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="what this CPU supports, and what hi_na_moe would do with a model")
    p.add_argument("--model", help="a local model directory to plan for: built on the meta device from its "
                   "config (no weight is read); lists its MoE blocks, bytes and the roofline tokens/s")
    p.add_argument("--output", choices=("text", "json"), default="text", help="text for people, json for machines")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the ~1-3 s memory bandwidth measurement")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=DEFAULT_GROUP_SIZE,
                   help=f"int4 group size for the per-format table (default {DEFAULT_GROUP_SIZE})")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("bench", help="prefill/decode speed, latency percentiles and GB/s, native vs hi_na_moe")
    p.add_argument("--model", required=True, help="a local model directory, or 'builtin' for the shipped model")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per batch (default 1)")
    p.add_argument("--seq-len", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--gen-tokens", type=int, default=32, help="new tokens per run (default 32)")
    p.add_argument("--num-iters", type=int, default=3, help="timed runs per arm (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per arm first (default 1)")
    p.add_argument("--threads", type=int, default=0, help="threads (default: torch.get_num_threads())")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="load the weights in this dtype (default: the checkpoint's)")
    p.add_argument("--compare", default="native,hina", help="arms, in order: native (transformers), hina")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="lossless",
                   help="expert format of the hina arm (quantised: also prints KL / top-1 vs native and SQNR)")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=DEFAULT_GROUP_SIZE, help=f"int4 group size (default {DEFAULT_GROUP_SIZE})")
    p.add_argument("--scope", choices=("experts", "all"), default=None,
                   help="'all' also runs the dense linear layers on the kernels (default: the config's, 'experts')")
    p.add_argument("--kv-cache", choices=("dynamic", "static"), default="dynamic",
                   help="transformers' KV cache for generate: dynamic (its default) or static (preallocated). "
                        "With a dynamic cache the hina arm under --scope all writes each new position in place; "
                        "the native arm, and the hina arm under --scope experts, copy the whole cache at every "
                        "step, which a static one avoids at long --seq-len (README 'Performance')")
    p.add_argument("--memory-limit", default=None,
                   help="the hina arm's memory_limit (8GiB, 50%%, bytes): packed experts beyond it are read from the "
                        "store by the memory tier, and its counters (hit rate, bytes read, prediction precision and "
                        "recall, I/O wait) are reported")
    p.add_argument("--top-k", default=None,
                   help="the hina arm's top_k: a whole number (each token's n largest-weight experts) or 'adaptive' "
                        "(see --top-k-threshold); the table then gives the experts a token used and the quality cost")
    p.add_argument("--top-k-threshold", type=float, default=None,
                   help="--top-k adaptive's threshold in even shares of a token's routing weight (default: the config's)")
    p.add_argument("--output", choices=("text", "json"), default="text")
    p.add_argument("--json-file", help="also write the full results, raw samples included, here")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("debug", help="replay natively and with hi_na_moe; show where outputs diverge")
    p.add_argument("--model", required=True, help="a local model directory (with its tokenizer)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts", help="a file with one prompt per line")
    p.add_argument("--isa", choices=ISA_TIERS, help="kernel tier to compare against native (default: the config's)")
    p.add_argument("--backend", choices=("auto", "native", "reference"), help="what runs the experts")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, help="expert format (default: the config's)")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), help="int4 group size")
    p.add_argument("--against", default="native",
                   help="what to compare with: native (default), or hi_na_moe with weights=FORMAT / isa=TIER")
    p.add_argument("--tolerance", type=float, help="relative L2 error per layer (default: 1e-4 fp32, 2e-2 bf16/fp16; "
                   "int8 5e-2, int4 2.5e-1)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="load the weights in this dtype (default: the checkpoint's)")
    p.add_argument("--output", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_debug)
    p = sub.add_parser("demo", help="generate natively and with hi_na_moe, compare tokens and speed")
    p.add_argument("--model", help="a local model directory; default: the small MoE shipped with the project")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt (default 24)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights dtype to load (default float32)")
    p.add_argument("--quick", action="store_true",
                   help="reduced workload (1 layer, few iterations): for CI, seconds instead of minutes")
    p.add_argument("--skip-workload", action="store_true", help="only the generation part")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("cache", help="see and remove the packed-expert store's entries (int8/int4/backups on disk)")
    csub = p.add_subparsers(dest="cache_command", required=True)
    c = csub.add_parser("list", help="one row per key directory: format, tier, layout, entries, size, last change")
    c.add_argument("--cache-dir", help="the store's directory (default: the config's cache_dir, HINA_MOE_CACHE_DIR, "
                   "else $XDG_CACHE_HOME/hi_na_moe or ~/.cache/hi_na_moe)")
    c.add_argument("--verify", action="store_true", help="check every entry's checksums (reads the whole store), "
                   "not only its header")
    c.add_argument("--output", choices=("text", "json"), default="text")
    c.set_defaults(func=cmd_cache_list)
    c = csub.add_parser("clear", help="remove store entries chosen by filters (confirmation asked unless --yes)")
    c.add_argument("--cache-dir", help="the store's directory (default: as for `cache list`)")
    c.add_argument("--key", help="one key directory: its full name or a unique prefix (the KEY column of `cache list`)")
    c.add_argument("--source", help="entries built from this checkpoint or model (a path, or a name as `cache list` "
                   "shows it under 'by source')")
    c.add_argument("--format", choices=WEIGHT_FORMATS, help="entries of this weight format")
    c.add_argument("--tier", choices=ISA_TIERS[1:], help="entries packed for this kernel tier")
    c.add_argument("--old-layout", action="store_true",
                   help="entries packed in another layout version than this build's (left behind when an upgrade "
                        "changed the packed layout; never read again)")
    c.add_argument("--stale", action="store_true", help="unreadable entries (corrupt, another store format version, "
                   "unsafe), temp files of interrupted writes, lock files without an entry")
    c.add_argument("--all", action="store_true", help="every store file (files that are not the store's stay)")
    c.add_argument("--verify", action="store_true", help="with --stale: find corrupt entries by their checksums too "
                   "(reads the whole store)")
    c.add_argument("--dry-run", action="store_true",
                   help="show what would be removed and how many bytes; remove nothing")
    c.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation (needed without a terminal)")
    c.add_argument("--output", choices=("text", "json"), default="text")
    c.set_defaults(func=cmd_cache_clear)
    p = sub.add_parser("profile-router", help="where tokens are routed: expert load, reuse, cache hit rates per "
                       "policy, next-layer prediction, cache-size advice")
    p.add_argument("--model", required=True, help="a local model directory (with its tokenizer), or 'builtin'")
    p.add_argument("--data", default="builtin", help="a text file, JSONL with a \"text\" field a line, or 'builtin' "
                   "(the project's held-out corpus, data/heldout.txt; the default)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens to profile (default 8192; the cache replay "
                   "costs a few microseconds per expert access, policy and size)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens a window (default 256, or the model's "
                   "max_position_embeddings if smaller)")
    p.add_argument("--batch-size", type=int, default=8, help="windows a forward (default 8)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="load the weights in this dtype (default: the checkpoint's)")
    p.add_argument("--out", help="directory for profile.json, expert_prior.json, routing.safetensors and the plots "
                   "(default ./router-profile-<model directory name>)")
    p.add_argument("--kl-budget", type=float, default=0.01,
                   help="advise the adaptive top-k threshold whose logits KL against the full model stays within "
                        "this many nats a token, measured by running the model again per threshold (default 0.01; "
                        "0: not measured)")
    p.add_argument("--json", action="store_true", help="print the whole profile as JSON instead of the summary")
    p.set_defaults(func=cmd_profile_router)
    p = sub.add_parser("distill", help="a smaller MoE: fewer experts a layer (and optionally a lower top-k), "
                       "chosen on calibration text, written as a plain transformers checkpoint")
    p.add_argument("--model", required=True, help="a local model directory (with its tokenizer), or 'builtin'")
    p.add_argument("--experts", type=int, required=True, help="experts each MoE block keeps (fewer than it has)")
    p.add_argument("--top-k", type=int, default=None, help="experts a token in the result (default: the model's, "
                   "or --experts if smaller); only a lower top-k lowers the bytes a token reads")
    p.add_argument("--method", choices=("prune", "merge"), default="prune",
                   help="prune: drop the lowest-scored experts; merge: fold each into its most similar kept "
                        "expert (frequency-weighted average). Default prune")
    p.add_argument("--score", choices=("frequency", "saliency", "random"), default="frequency",
                   help="how experts are ranked: routing frequency, REAP-style saliency (router weight x expert "
                        "output norm), or random (a baseline). Default frequency")
    p.add_argument("--data", default="builtin", help="calibration text: a text file, JSONL with a \"text\" field a "
                   "line, or 'builtin' (data/heldout.txt; the default)")
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens (default 8192)")
    p.add_argument("--seed", type=int, default=0, help="seed of --score random and of the repair's batches (default 0)")
    p.add_argument("--repair-steps", type=int, default=0, help="then fine-tune the routers this many steps with the "
                   "original as teacher (KL on the logits, on the calibration tokens; ~0.4 s a step on the shipped "
                   "model, one thread). Default 0: no repair")
    p.add_argument("--repair-lr", type=float, default=1e-3, help="the repair's Adam learning rate (default 1e-3)")
    p.add_argument("--repair-experts", action="store_true", help="the repair trains the routed experts' weights "
                   "too, not only the routers")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="load (and write) the weights in this dtype (default: the checkpoint's)")
    p.add_argument("--out", required=True, help="the directory to write (refused if not empty, unless --force)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--output", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_distill)
    add_serve_parser(sub, WEIGHT_FORMATS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"hi-na-moe: error: {exc}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"hi-na-moe: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
