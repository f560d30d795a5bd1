"""`hi-na-moe profile-router`: which experts a model's routers pick on a text."""

from __future__ import annotations

import sys
from pathlib import Path

from ...integrate.adapters import discover
from ..profile_router import ProfileError, profile_router
from . import common
from .common import UserError, shipped_model_dir


def cmd_profile_router(args) -> int:
    """Route text through a model, record every routing decision, and write the profile."""
    for name in ("tokens", "seq_len", "batch_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    kl_budget = getattr(args, "kl_budget", None)
    if kl_budget is not None and not kl_budget >= 0:
        raise UserError(f"--kl-budget must be >= 0 nats a token, got {kl_budget}", "0 skips the adaptive top-k advice")
    path = shipped_model_dir() if args.model == "builtin" else args.model
    if path is None:
        raise UserError("--model builtin: the shipped model (models/hina-tiny-moe) is not in this installation",
                        "pass --model PATH")
    # the data before the model: a bad file is named without waiting for a load
    texts, special = common.read_data(args.data)
    model, tokenizer = common._load(path, args.dtype)
    if not discover(model):
        raise UserError(f"no MoE block found in {str(path)!r} ({type(model).__name__})",
                        "profile-router records how MoE blocks route tokens to experts; is this an MoE model?")
    if tokenizer is None:
        raise UserError(f"{str(path)!r} has no tokenizer (tokenizer.json / tokenizer_config.json)",
                        "save the model's tokenizer into the directory with tokenizer.save_pretrained")
    try:
        profile = profile_router(model, tokenizer, texts, tokens=args.tokens, seq_len=args.seq_len,
                                 batch_size=args.batch_size, add_special_tokens=special, progress=True,
                                 kl_budget=kl_budget or None)
    except ProfileError as exc:
        raise UserError(f"{str(path)!r}: {exc}") from None
    out = Path(args.out) if args.out else Path(f"router-profile-{Path(path).resolve().name}")
    try:
        saved = profile.save(out)
    except OSError as exc:
        raise UserError(f"cannot write the profile to {str(out)!r}: {exc.strerror or exc}") from None
    if args.json:
        print(profile.to_json())
    else:
        print(profile.summary())
        print()
        print("wrote " + ", ".join(saved["files"]))
    if saved["plots_skipped"]:
        print(saved["plots_skipped"], file=sys.stderr if args.json else sys.stdout)
    return 0
