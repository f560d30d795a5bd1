"""Write a transformers tokenizer for a random-weight checkpoint, holding the synthetic vocabulary
that make_gguf.py writes into its GGUF files, so a server that needs a tokenizer (`hi-na-moe
serve --tokenizer DIR`) and llama.cpp's llama-server detokenize the same ids to the same text.

    python benchmarks/synthetic_tokenizer.py --vocab-size 50304 --out /work/ckpt/olmoe-1b-7b-tokenizer
    python benchmarks/synthetic_tokenizer.py --like /work/ckpt/olmoe-1b-7b --out DIR   # its config's vocab_size

The vocabulary (`synthetic_tokens`, the one list make_gguf.py also reads): id 0 <unk>, 1 <s>
(bos), 2 </s> (eos), then the 256 byte tokens <0x00>..<0xFF>, then "▁t{i}" up to vocab_size.
The tokenizer is a `tokenizers` Unigram model with byte fallback and SentencePiece's "▁" word
marker, loaded as PreTrainedTokenizerFast; it adds no bos (the GGUF says add_bos_token false).
Every id below vocab_size decodes ("▁t7" to " t7", a byte token to its byte). Encoding text is
for convenience only: llama.cpp's SPM tokenizer merges characters pairwise and so never forms
"▁t7" from text, so text encodes differently in the two engines; benchmarks send token ids.

Needs only `tokenizers` (and transformers to check the result: --check).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
N_FIXED = len(SPECIALS) + 256


def synthetic_tokens(n: int) -> list[str]:
    """The synthetic SentencePiece-shaped vocabulary of `n` tokens (make_gguf.py's too)."""
    if n < N_FIXED:
        raise ValueError(f"vocab_size {n} too small for the synthetic vocabulary: it needs at least {N_FIXED} "
                         "(<unk>, <s>, </s> and 256 byte tokens)")
    return list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + [f"\u2581t{i}" for i in range(n - N_FIXED)]


def build(n: int):
    """The tokenizers.Tokenizer of the synthetic vocabulary of `n` tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = synthetic_tokens(n)
    # Unigram log-probabilities: the byte tokens are reached only through byte fallback, and a
    # lower "▁t{i}" id is the likelier piece (make_gguf.py's scores order them the same way)
    vocab = [(t, 0.0) for t in tokens[:N_FIXED]] + [(t, -1.0 - i) for i, t in enumerate(tokens[N_FIXED:])]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def write(n: int, out: Path, model_max_length: int = 4096) -> Path:
    """tokenizer.json and tokenizer_config.json for the synthetic vocabulary of `n` tokens in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    build(n).save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False,
           "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=1) + "\n")
    return out


def check(out: Path, n: int) -> None:
    """Load `out` with AutoTokenizer and decode every id; raise on the first that is wrong."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    if len(tok) != n or tok.bos_token_id != 1 or tok.eos_token_id != 2 or tok.unk_token_id != 0:
        raise SystemExit(f"{out}: loaded {len(tok)} tokens, bos {tok.bos_token_id}, eos {tok.eos_token_id}, "
                         f"unk {tok.unk_token_id}; expected {n}, 1, 2, 0")
    tokens = synthetic_tokens(n)
    for i in range(n):
        piece = tok.convert_ids_to_tokens(i)
        if piece != tokens[i]:
            raise SystemExit(f"{out}: id {i} is {piece!r}, expected {tokens[i]!r}")
    text = tok.decode(list(range(N_FIXED, n)))  # every word token in one text
    if text.split(" ") != [f"t{i}" for i in range(n - N_FIXED)]:
        raise SystemExit(f"{out}: the word tokens do not decode to 't0 t1 ...'")
    if tok.decode([3 + ord("h"), 3 + ord("i")]) != "hi":
        raise SystemExit(f"{out}: the byte tokens do not decode to their bytes")
    ids = tok.encode("t5 t17", add_special_tokens=True)
    if ids != [N_FIXED + 5, N_FIXED + 17]:
        raise SystemExit(f"{out}: 't5 t17' encodes to {ids}, expected {[N_FIXED + 5, N_FIXED + 17]}")
    print(f"{out}: AutoTokenizer loads {n} tokens; every id decodes; bos 1, eos 2, unk 0")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--vocab-size", type=int, help="tokens in the vocabulary (the checkpoint's vocab_size)")
    src.add_argument("--like", type=Path, help="a checkpoint directory whose config.json gives vocab_size")
    ap.add_argument("--out", type=Path, required=True, help="directory to write the tokenizer files into")
    ap.add_argument("--max-length", type=int, default=None,
                    help="model_max_length (default: --like's max_position_embeddings, else 4096)")
    ap.add_argument("--no-check", action="store_true", help="do not load the result back with transformers")
    args = ap.parse_args(argv)
    max_len = args.max_length or 4096
    if args.like is not None:
        cfg_path = args.like / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--like: cannot read {cfg_path}: {e}")
        cfg = cfg.get("text_config", cfg)
        if "vocab_size" not in cfg:
            raise SystemExit(f"--like: {cfg_path} has no vocab_size; pass --vocab-size")
        n = int(cfg["vocab_size"])
        max_len = args.max_length or int(cfg.get("max_position_embeddings", 4096))
    else:
        n = args.vocab_size
    try:
        synthetic_tokens(n)
    except ValueError as e:
        raise SystemExit(f"--vocab-size: {e}")
    write(n, args.out, max_len)
    print(f"wrote {args.out}/tokenizer.json, tokenizer_config.json ({n} tokens)")
    if not args.no_check:
        check(args.out, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
