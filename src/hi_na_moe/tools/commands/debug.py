"""`hi-na-moe debug`: the first decoder layer whose accelerated output leaves the tolerance."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..debug import compare
from . import common
from .common import UserError, _config_up_front


def cmd_debug(args) -> int:
    if not args.prompt and not args.prompts:
        raise UserError("debug needs --prompt TEXT or --prompts FILE")
    if args.tolerance is not None and not (args.tolerance > 0 and math.isfinite(args.tolerance)):
        raise UserError(f"--tolerance must be a number > 0, got {args.tolerance:g}",
                        "a relative L2 error per layer, e.g. 1e-4")
    config = {k: v for k, v in (("isa", args.isa), ("backend", args.backend), ("weights", args.weights),
                                 ("group_size", args.group_size)) if v}
    _config_up_front({k: (v, "--" + k.replace("_", "-")) for k, v in config.items()})
    baseline = None
    if args.against != "native":
        key, _, value = args.against.partition("=")
        if key not in ("weights", "isa") or not value:
            raise UserError(f"--against {args.against!r}: expected native, weights=FORMAT or isa=TIER",
                            "e.g. --weights int4 --against weights=int8, or --isa avx2 --against isa=avx512")
        baseline = {key: value, **({"group_size": args.group_size} if key == "weights" and args.group_size else {})}
        _config_up_front({k: (v, "--against" if k == key else "--group-size") for k, v in baseline.items()})
    prompts = list(args.prompt or [])
    if args.prompts:
        f = Path(args.prompts)
        if not f.is_file():
            raise UserError(f"--prompts file {args.prompts!r} does not exist")
        prompts += [line for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    model, tokenizer = common._load(args.model, args.dtype)
    if tokenizer is None:
        raise UserError(f"{args.model!r} has no tokenizer to encode the prompts",
                        "save the tokenizer next to the model (tokenizer.save_pretrained)")
    reports = []
    for prompt in prompts:
        inputs = dict(tokenizer(prompt, return_tensors="pt"))
        rep = compare(model, inputs, tolerance=args.tolerance, baseline=baseline, **config)
        reports.append((prompt, rep))
    ok = all(r.ok for _, r in reports)
    if args.output == "json":
        print(json.dumps({"ok": ok, "prompts": [{"prompt": p, **r.to_dict()} for p, r in reports]}, indent=2))
    else:
        for prompt, rep in reports:
            print(f"\nprompt: {prompt!r}")
            print(rep)
    return 0 if ok else 1
