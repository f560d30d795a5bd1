"""Checks of the shipped model models/hina-tiny-moe (trained by scripts/train_tiny_moe.py).

The thresholds are margins around numbers measured on the shipped weights (see
models/hina-tiny-moe/training_stats.json, key "test_slice"); they are not tautologies: an
untrained or broken model fails them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "models" / "hina-tiny-moe"
DATA_DIR = REPO / "data"

SEQ_LEN = 256  # training window; the script's test slice is the first TEST_CHUNKS windows
TEST_CHUNKS = 16
MAX_WEIGHT_BYTES = 25_000_000

# Margins around what the shipped weights measure on the test slice (training_stats.json
# "test_slice"): ppl 115.8 vs unigram 814.1 (ratio 0.142); per-layer load entropy
# 2.83/2.67/2.70/2.47 bits (uniform: 3); mean per-token router entropy 1.13/1.46/1.64/1.63 bits.
MAX_PPL_RATIO = 0.25
MAX_LOAD_ENTROPY_BITS = 2.95
MAX_ROUTER_ENTROPY_BITS = 2.0  # a freshly initialised router is near-uniform: ~3 bits


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    m.eval()
    return m


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def stats():
    return json.loads((MODEL_DIR / "training_stats.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def test_chunks(tokenizer):
    text = (DATA_DIR / "heldout.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) >= TEST_CHUNKS * SEQ_LEN
    return torch.tensor(ids[: TEST_CHUNKS * SEQ_LEN]).view(TEST_CHUNKS, SEQ_LEN)


@pytest.fixture(scope="module")
def forward(model, test_chunks):
    with torch.no_grad():
        return model(input_ids=test_chunks, output_router_logits=True)


def test_files_and_size():
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "README.md", "training_stats.json"):
        assert (MODEL_DIR / name).is_file(), name
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= MAX_WEIGHT_BYTES


def test_loads_as_moe(model, tokenizer):
    from transformers import OlmoeForCausalLM

    assert isinstance(model, OlmoeForCausalLM)
    cfg = model.config
    assert 8 <= cfg.num_experts <= 16 and cfg.num_experts_per_tok == 2
    assert cfg.num_hidden_layers >= 4
    assert cfg.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == cfg.eos_token_id
    assert tokenizer.pad_token_id == cfg.pad_token_id != cfg.eos_token_id
    text = "Return the number of items in the container."
    enc = tokenizer(text).input_ids
    assert enc[0] == tokenizer.bos_token_id  # BOS prepended, as in training
    assert tokenizer.decode(enc, skip_special_tokens=True) == text


def test_heldout_perplexity_far_below_unigram(model, forward, test_chunks, stats):
    logits = forward.logits[:, :-1].float()
    targets = test_chunks[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    ppl = math.exp(float(nll))

    uni = json.loads((DATA_DIR / "train_unigram_counts.json").read_text())
    counts = torch.tensor(uni["counts"], dtype=torch.float64) + 1.0  # add-one smoothing
    assert len(counts) == model.config.vocab_size
    uni_ppl = math.exp(float(-(counts / counts.sum()).log()[targets.reshape(-1)].mean()))

    # Measured: see training_stats.json test_slice (model_ppl, unigram_ppl, ppl_ratio).
    assert ppl < MAX_PPL_RATIO * uni_ppl, (ppl, uni_ppl)
    # The shipped statistics describe these very weights.
    assert ppl == pytest.approx(stats["test_slice"]["model_ppl"], rel=1e-3)
    assert uni_ppl == pytest.approx(stats["test_slice"]["unigram_ppl"], rel=1e-6)


def test_routing_is_not_uniform(model, forward, stats):
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    assert len(forward.router_logits) == cfg.num_hidden_layers
    entropies = []
    for logits in forward.router_logits:
        chosen = torch.topk(logits, k, dim=-1).indices.reshape(-1)
        p = torch.bincount(chosen, minlength=E).double()
        p = p / p.sum()
        p = p[p > 0]
        entropies.append(float(-(p * p.log2()).sum()))
    # uniform load would be log2(E) bits; measured values in training_stats.json test_slice
    assert max(entropies) < MAX_LOAD_ENTROPY_BITS <= math.log2(E), entropies
    assert entropies == pytest.approx(stats["test_slice"]["load_entropy_bits"], abs=1e-3)


def test_routers_are_confident(model, forward):
    # Experts specialise: each token's router distribution is far from uniform.
    for logits in forward.router_logits:
        p = torch.softmax(logits.double(), dim=-1)
        mean_entropy = float(-(p * p.clamp_min(1e-30).log2()).sum(-1).mean())
        assert mean_entropy < MAX_ROUTER_ENTROPY_BITS, mean_entropy


def test_greedy_generation_is_wordy(model, tokenizer):
    enc = tokenizer("The function returns", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)
    words = [w for w in text.split() if w.strip(".,;:()'\"").isalpha()]
    assert len(words) >= 5, text
