"""`hi-na-moe distill`: a smaller MoE (fewer experts a layer, optionally a lower top-k) written as a
plain transformers checkpoint."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ..distill import STATE_FILE, DistillError, check_out, distill, model_card, repair, save_distilled
from ..profile_router import ProfileError, _token_ids
from . import common
from .common import UserError, shipped_model_dir


def repair_state_dir(out) -> Path:
    """Where `hi-na-moe distill --out OUT --repair-steps N` keeps its repair's state: .OUT.repair-state
    beside OUT."""
    p = Path(out).expanduser()
    return p.resolve().parent / f".{p.name}.repair-state"


def cmd_distill(args) -> int:
    """Check every option and the output directory, load, calibrate, distill, write."""
    if args.experts < 1:
        raise UserError(f"--experts must be >= 1, got {args.experts}")
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_k is not None and args.top_k > args.experts:
        raise UserError(f"--top-k {args.top_k} is more than --experts {args.experts}",
                        "a token cannot be routed to more experts than a layer keeps")
    if args.tokens < 1:
        raise UserError(f"--tokens must be >= 1, got {args.tokens}")
    if args.repair_steps < 0:
        raise UserError(f"--repair-steps must be >= 0, got {args.repair_steps}")
    if not args.repair_lr > 0:
        raise UserError(f"--repair-lr must be > 0, got {args.repair_lr}")
    if args.repair_experts and not args.repair_steps:
        raise UserError("--repair-experts needs --repair-steps N (N >= 1)")
    path = shipped_model_dir() if args.model == "builtin" else args.model
    if path is None:
        raise UserError("--model builtin: the shipped model (models/hina-tiny-moe) is not in this installation",
                        "pass --model PATH")
    # the output and the data before the model: a mistake in either is named without waiting for a load
    try:
        check_out(args.out, args.force)
    except DistillError as exc:
        raise UserError(str(exc)) from None
    texts, special = common.read_data(args.data)
    model, tokenizer = common._load(path, args.dtype)
    if tokenizer is None:
        raise UserError(f"{str(path)!r} has no tokenizer (tokenizer.json / tokenizer_config.json)",
                        "save the model's tokenizer into the directory with tokenizer.save_pretrained")
    try:
        ids = _token_ids(tokenizer, texts, special)[: args.tokens]
    except ProfileError as exc:
        raise UserError(f"--data: {exc}") from None
    try:
        small = distill(model, args.experts, top_k=args.top_k, method=args.method, score=args.score, data=ids,
                        tokens=args.tokens, seed=args.seed, progress=args.output != "json")
        if args.repair_steps:
            # the repair's last saved step, beside --out: the same command run again after a kill
            # continues from it; removed once the checkpoint is written
            state = repair_state_dir(args.out)
            if (state / STATE_FILE).is_file():
                print(f"repair: continuing from the state saved in {state}", file=sys.stderr)
            repair(small, model, ids, steps=args.repair_steps, lr=args.repair_lr, seed=args.seed,
                   train_experts=args.repair_experts, progress=args.output != "json", state=state)
        out = save_distilled(small, args.out, force=args.force, tokenizer=tokenizer)
        if args.repair_steps:
            shutil.rmtree(state, ignore_errors=True)
    except DistillError as exc:
        raise UserError(f"{str(path)!r}: {exc}") from None
    report = small.distill_report
    if args.output == "json":
        print(json.dumps(dict(report.to_dict(), out=str(Path(out).resolve())), indent=1))
    else:
        print(model_card(report).rstrip())
        print()
        print(f"wrote {out}")
    return 0
