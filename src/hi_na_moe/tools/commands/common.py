"""What the commands share: user errors, the shipped model, loading a model, the config up front, exact generation."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ...core.checkpoint import CheckpointError, PickleRefused, checkpoint_dir, safetensors_only
from ...core.config import (
    load_config,
)
from ...core.native import native_module
from ..profile_router import ProfileError, builtin_data, read_texts


class UserError(Exception):
    """A mistake the user can fix; printed as one line plus a hint, no traceback."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def shipped_model_dir() -> Path | None:
    """The small trained MoE shipped in the repository (models/hina-tiny-moe), if present."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "models" / "hina-tiny-moe"
        if (candidate / "config.json").is_file():
            return candidate
    return None


def _load(path: str | Path, dtype: str):
    from transformers import AutoConfig, AutoModelForCausalLM  # import cost: 0.26 s (measured 2026-12-07)


    try:
        p = checkpoint_dir(path)  # each thing wrong with the directory its own message, naming it
    except (OSError, PickleRefused, CheckpointError) as exc:
        raise UserError(str(exc)) from None
    try:
        AutoConfig.from_pretrained(p)
    except Exception as exc:  # unknown model type, broken json
        raise UserError(f"cannot read the config in {str(p)!r}: {exc}") from None

    try:
        with safetensors_only():  # a model directory's pickles are never unpickled
            model = AutoModelForCausalLM.from_pretrained(
                p, dtype=getattr(torch, dtype) if dtype else "auto", use_safetensors=True).eval()
    except PickleRefused as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        if "safetensors" not in str(exc):
            raise
        raise UserError(f"{str(p)!r} has no safetensors weights ({exc})",
                        "hi_na_moe never loads pickled (*.bin) weights; convert the checkpoint with save_pretrained")
    tokenizer = None
    if (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer  # import cost: 0.27 s (measured 2026-12-07)

        tokenizer = AutoTokenizer.from_pretrained(p)
    return model, tokenizer


def _config_up_front(options: dict[str, tuple[object, str]] | None = None):
    """The config a command will enable with, built before anything is loaded: a bad option
    value, HINA_MOE_* variable or config file (or a tier this CPU lacks) is refused then, not
    after a model load. options: key -> (value, the option it came from); None values are left
    out. ConfigError names the key, the value and the option, variable or file."""
    given = {k: v for k, (v, _) in (options or {}).items() if v is not None}
    return load_config(where={k: flag for k, (_, flag) in (options or {}).items()}, **given)


def _tiny_random_model():
    """A small random OLMoE, for when no trained model is available: it shows the mechanics and
    the exactness check, not meaningful text."""
    from transformers import OlmoeConfig, OlmoeForCausalLM  # import cost: 0.23 s (measured 2026-12-07)

    cfg = OlmoeConfig(hidden_size=256, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=512, num_experts=16, num_experts_per_tok=2,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return OlmoeForCausalLM(cfg).eval()


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def _exactly(model, ids, n: int, on_retry=None, **kw):
    """Greedy generate() of exactly n new tokens: end-of-sequence turned off (eos_token_id=None),
    not suppressed at every step with min_new_tokens, whose logits processors (an EOS mask over
    the vocabulary, then a where) cost 1.6 ms a step on a 151936-token vocabulary (Qwen's), for
    transformers and hi_na_moe alike (benchmarks/log/decode-step.md, 2026-12-05). A transformers that
    reads eos_token_id=None as "the model's own" and stops early gets min_new_tokens after all
    (said on stderr, once; on_retry() is called first). Call under inference mode."""
    global _EOS_OFF_IGNORED
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, **kw)
    if out.shape[1] - ids.shape[1] >= n:
        return out
    if not _EOS_OFF_IGNORED:
        _EOS_OFF_IGNORED = True
        print("note: generate() stopped at the end-of-sequence token with eos_token_id=None; "
              "using min_new_tokens instead (its logits processors add to every step's time)", file=sys.stderr)
    if on_retry is not None:
        on_retry()
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


_EOS_OFF_IGNORED = False


def _generate(model, ids, n):
    start = time.perf_counter()
    with torch.inference_mode():
        out = _exactly(model, ids, n)
    return out, time.perf_counter() - start


def _bandwidth(threads: int) -> float:
    """Best of a few ~1 GiB read passes (GB/s), NaN without the native library."""
    native, _ = native_module()
    return native.measure_read_bandwidth(1 << 30, threads, 3)["best_gbs"] if native is not None else float("nan")


def read_data(data: str) -> tuple[list[str], bool]:
    """--data of profile-router and distill: (texts, whether the tokenizer adds its special tokens).
    "builtin" is the project's held-out corpus, one stream with its own separators; anything else
    a text file or JSONL with a "text" field a line. UserError names what is wrong."""
    try:
        if data == "builtin":
            path = builtin_data()
            if path is None:
                raise UserError("--data builtin: the project's held-out corpus (data/heldout.txt) is not in this "
                                "installation", "pass --data FILE (text, or JSONL with a \"text\" field)")
            return [path.read_text(encoding="utf-8")], False
        return read_texts(data), True
    except ProfileError as exc:
        raise UserError(str(exc), "pass a UTF-8 text file, JSONL with a \"text\" field a line, or builtin") from None
