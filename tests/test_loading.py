"""hi_na_moe.from_pretrained: experts streamed from the checkpoint into the packed-expert store.
Same outputs as transformers' load + enable_for_model, exact state_dict and restore, and a warm
load that neither packs nor reads the expert tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hi_na_moe
from hi_na_moe.core import ops
from hi_na_moe.core.native import native_kernels_available

from tiny_models import build_tiny

pytestmark = pytest.mark.skipif(not native_kernels_available(), reason="native library not built")

# per-expert checkpoint keys (olmoe, mixtral, qwen2_moe + shared experts), fused 3-D keys with
# biases (gpt_oss), a block adapter whose dense MLP has the experts' sizes (doge: on the meta
# device, tensors of equal size once got confused)
FAMILIES = ["olmoe", "mixtral", "qwen2_moe", "gpt_oss", "doge"]


@pytest.fixture(autouse=True)
def _store(tmp_path, monkeypatch):
    monkeypatch.setenv("HINA_MOE_CACHE_DIR", str(tmp_path / "store"))


def _checkpoint(model_type, tmp_path):
    tiny = build_tiny(model_type, torch.bfloat16)
    path = tmp_path / model_type
    tiny.model.save_pretrained(path)
    return path, tiny.vocab_size


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("weights", ["int4", "int8", "lossless"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_same_as_enable_for_model_and_exact_restore(model_type, weights, tmp_path):
    path, vocab = _checkpoint(model_type, tmp_path)
    ids = torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    base = _logits(ref, ids)
    sd0 = {k: v.clone() for k, v in ref.state_dict().items()}
    hi_na_moe.enable_for_model(ref, weights=weights, cache_dir=str(tmp_path / "other"))
    want = _logits(ref, ids)
    hi_na_moe.disable_for_model(ref)

    model = hi_na_moe.from_pretrained(path, weights=weights, dtype=torch.bfloat16, progress=False)
    rep = hi_na_moe.report_for(model)
    assert rep.accelerated and not rep.native, rep
    assert all("never loaded" in (b.reason or "") for b in rep.accelerated)
    assert torch.equal(_logits(model, ids), want), f"{model_type} {weights}: differs from enable_for_model"
    if weights != "lossless":
        assert all(b.sqnr_db is not None for b in rep.accelerated)
    # the experts were never in memory: placeholders (stride 0) where their parameters are
    runner = next(c.runner for _, _, c in hi_na_moe.integrate.patching._ROOTS[model][0] if isinstance(c.runner, ops.NativeExperts))
    assert all(t.numel() == 0 or 0 in t.stride() for t in runner.spec.weight_tensors()
               if t.dim() == 3), "expert weights were materialised"
    sd = model.state_dict()
    bad = [k for k in sd0 if not torch.equal(sd[k], sd0[k])]
    assert not bad, f"{model_type}: state_dict differs from the checkpoint while enabled: {bad[:3]}"
    hi_na_moe.disable_for_model(model)
    assert torch.equal(_logits(model, ids), base), f"{model_type}: restore from the checkpoint not exact"


def test_warm_load_neither_packs_nor_reads_experts(tmp_path, monkeypatch):
    import transformers.core_model_loading as cml

    path, vocab = _checkpoint("olmoe", tmp_path)
    reads = []
    real = cml._materialize_copy

    def counting(tensor, *a, **k):
        reads.append(tuple(tensor.shape) if hasattr(tensor, "shape") else None)
        return real(tensor, *a, **k)

    monkeypatch.setattr(cml, "_materialize_copy", counting)
    cold = hi_na_moe.from_pretrained(path, weights="int4", dtype=torch.bfloat16, progress=False)
    cold_reads = len(reads)
    assert {b.cache for b in hi_na_moe.report_for(cold).accelerated} == {"built"}
    reads.clear()

    def no_packing(self, tensors, weights):
        raise AssertionError("packed again although the store has every block")

    monkeypatch.setattr(ops.NativeExperts, "_pack_now", no_packing)
    warm = hi_na_moe.from_pretrained(path, weights="int4", dtype=torch.bfloat16, progress=False)
    assert {b.cache for b in hi_na_moe.report_for(warm).accelerated} == {"reused"}
    # per-expert checkpoint: 3 tensors per expert per layer were not read the second time
    cfg = warm.config
    experts = cfg.num_experts * 3 * cfg.num_hidden_layers
    assert cold_reads - len(reads) == experts, (cold_reads, len(reads), experts)
    ids = torch.randint(3, vocab, (1, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(cold, ids), _logits(warm, ids))


def test_config_keys_as_keyword_arguments(tmp_path):
    # hi_na_moe's config keys given as keywords configure hi_na_moe (they used to reach the
    # model class's constructor, a TypeError about the model's __init__); the rest still go to
    # transformers; a keyword overrides the config object, as in enable_for_model
    path, vocab = _checkpoint("olmoe", tmp_path)
    store = tmp_path / "kw-store"
    model = hi_na_moe.from_pretrained(path, weights="int8", dtype=torch.bfloat16, progress=False, scope="all",
                                      dense_lossless="", cache_dir=str(store), threads=1,
                                      config=hi_na_moe.load_config(scope="experts", threads=2))
    assert model.dtype == torch.bfloat16
    rep = hi_na_moe.report_for(model)
    assert rep.config["scope"] == "all" and rep.config["threads"] == 1 and rep.config["cache_dir"] == str(store)
    assert rep.config["dense_lossless"] == ""
    assert rep.norms and rep.routers, "scope='all' did not reach the norms and routers"
    assert any(store.rglob("*.hnm")), "the store given by cache_dir= was not used"
    hi_na_moe.disable_for_model(model)
    with pytest.raises(hi_na_moe.ConfigError, match="scope"):
        hi_na_moe.from_pretrained(path, scope="everything", progress=False)


def test_store_entries_record_what_they_were_built_from(tmp_path):
    # `hi-na-moe cache list` groups keys by it: the checkpoint's absolute path for from_pretrained,
    # the model's name_or_path (or its class, built in memory) for enable_for_model
    from hi_na_moe.core.store import PackedStore

    path, _ = _checkpoint("olmoe", tmp_path)
    a, b, c = (tmp_path / n for n in ("store-a", "store-b", "store-c"))
    model = hi_na_moe.from_pretrained(path, weights="int8", dtype=torch.bfloat16, progress=False, cache_dir=str(a))
    hi_na_moe.disable_for_model(model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hi_na_moe.enable_for_model(model, weights="int8", cache_dir=str(b))
    hi_na_moe.disable_for_model(model)
    built = build_tiny("olmoe", torch.bfloat16).model
    hi_na_moe.enable_for_model(built, weights="int8", cache_dir=str(c))
    hi_na_moe.disable_for_model(built)
    for root, want in ((a, str(path.resolve())), (b, str(path)), (c, "OlmoeForCausalLM (in memory)")):
        store = PackedStore(root)
        infos = store.entries()
        assert infos, root
        assert {store.open(i.key, i.name).meta.get("source") for i in infos} == {want}, root


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="'.*nothing-here' does not exist.*download it first"):
        hi_na_moe.from_pretrained(tmp_path / "nothing-here")
    path, _ = _checkpoint("olmoe", tmp_path)
    with pytest.raises(ValueError, match="cache must be on"):
        hi_na_moe.from_pretrained(path, config=hi_na_moe.load_config(cache=False))
    with pytest.raises(hi_na_moe.ConfigError, match="group_size"):
        hi_na_moe.from_pretrained(path, weights="int4", group_size=48)


def test_block_not_made_of_whole_parameters_is_loaded_normally(tmp_path):
    """LongCat's experts are rows of a larger tensor (zero-computation experts beside them): the
    block is not streamed, transformers loads it and enable_for_model packs it; same outputs."""
    path, vocab = _checkpoint("longcat_flash", tmp_path)
    ids = torch.randint(3, vocab, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    base = _logits(ref, ids)
    hi_na_moe.enable_for_model(ref, weights="int4", cache_dir=str(tmp_path / "other"))
    want = _logits(ref, ids)
    hi_na_moe.disable_for_model(ref)
    model = hi_na_moe.from_pretrained(path, weights="int4", dtype=torch.bfloat16, progress=False)
    rep = hi_na_moe.report_for(model)
    assert rep.accelerated and not any("never loaded" in (b.reason or "") for b in rep.accelerated)
    assert torch.equal(_logits(model, ids), want)
    hi_na_moe.disable_for_model(model)
    assert torch.equal(_logits(model, ids), base)


# ---------------------------------------------------------------------------------------------
# A checkpoint directory that is not what it should be: each its own message, naming the path


def _sharded(tmp_path):
    tiny = build_tiny("olmoe", torch.bfloat16)
    path = tmp_path / "sharded"
    tiny.model.save_pretrained(path, max_shard_size="100KB")
    return path


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_truncated_safetensors_file_is_named_before_transformers_reads_it(tmp_path, sharded):
    """A download or copy cut short: half of the file (the header intact, the data cut) used to
    be a SafetensorError six frames inside transformers, naming no file."""
    import os

    from hi_na_moe.tools.commands import common as cli_common
    from hi_na_moe.core import checkpoint

    path = _sharded(tmp_path) if sharded else _checkpoint("olmoe", tmp_path)[0]
    victim = sorted(path.glob("*.safetensors"))[-1]
    os.truncate(victim, victim.stat().st_size // 2)
    want = (rf"{victim.name}'? is truncated or corrupt: .*tensor '[^']+' .*ends at byte \d+ but the file has "
            rf"\d+ bytes; download it again or save the checkpoint again")
    with pytest.raises(checkpoint.CheckpointError, match=want):
        hi_na_moe.from_pretrained(path, weights="int8", progress=False)
    with pytest.raises(cli_common.UserError, match=want):
        cli_common._load(path, None)


def test_safetensors_headers_are_checked_field_by_field(tmp_path):
    import json
    import struct

    from hi_na_moe.core.checkpoint import CheckpointError, check_safetensors

    def write(name, header, data=b"", length=None):
        raw = json.dumps(header).encode()
        f = tmp_path / name
        f.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
        return f

    def raw(name, content):
        f = tmp_path / name
        f.write_bytes(content)
        return f

    good = {"a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}, "__metadata__": {"format": "pt"}}
    check_safetensors(write("ok.safetensors", good, bytes(8)))
    cases = {
        "only 5 bytes": lambda: raw("tiny.safetensors", b"12345"),
        "header of 4096 bytes does not fit": lambda: write("long.safetensors", good, bytes(8), length=4096),
        "header is not JSON": lambda: raw("bad.safetensors", struct.pack("<Q", 3) + b"{x}"),
        r"tensor 'a' has shape \[2, 3\] of BF16 \(12 bytes\) but data_offsets of 8 bytes": lambda: write("shape.safetensors", {"a": {**good["a"], "shape": [2, 3]}}, bytes(8)),
        r"tensor 'a' ends at byte \d+ but the file has \d+ bytes": lambda: write("short.safetensors", good, bytes(4)),
        "4 bytes after the last tensor": lambda: write("long_data.safetensors", good, bytes(12)),
        "tensor 'b' starts at byte 12 of the data, where 'a' ends at byte 8": lambda: write(
            "gap.safetensors", {**good, "b": {"dtype": "U8", "shape": [4], "data_offsets": [12, 16]}}, bytes(16)),
        "tensor 'a' has a malformed entry": lambda: write("offsets.safetensors", {"a": {**good["a"],
                                                                                       "data_offsets": [8, 0]}}),
    }
    for what, make in cases.items():
        f = make()
        with pytest.raises(CheckpointError, match=f"'{f}' is truncated or corrupt: {what}.*download it again"):
            check_safetensors(f)


def test_pickle_only_checkpoints_are_refused_as_pickles(tmp_path):
    """A directory with only pytorch_model.bin (or an index naming only .bin shards): the
    PickleRefused the README promises, naming the file, not 'download it first'."""
    import json
    import shutil

    from hi_na_moe.tools.commands import common as cli_common
    from hi_na_moe.core.checkpoint import PickleRefused

    path, _ = _checkpoint("olmoe", tmp_path)
    only_bin = tmp_path / "only_bin"
    only_bin.mkdir()
    shutil.copy(path / "config.json", only_bin / "config.json")
    (only_bin / "pytorch_model.bin").write_bytes(b"not unpickled")  # never opened
    index_bin = tmp_path / "index_bin"
    index_bin.mkdir()
    shutil.copy(path / "config.json", index_bin / "config.json")
    (index_bin / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "pytorch_model-00001-of-00001.bin"}}))
    pt_index = tmp_path / "pt_index"
    pt_index.mkdir()
    shutil.copy(path / "config.json", pt_index / "config.json")
    (pt_index / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "pytorch_model-00001-of-00001.bin"}}))
    for d, name in ((only_bin, "pytorch_model.bin"), (index_bin, "pytorch_model-00001-of-00001.bin"),
                    (pt_index, "pytorch_model.bin.index.json")):
        with pytest.raises(PickleRefused, match=rf"{name}.*reads only safetensors"):
            hi_na_moe.from_pretrained(d, weights="int8", progress=False)
        with pytest.raises(cli_common.UserError, match=rf"{name}.*reads only safetensors"):
            cli_common._load(d, None)


def test_a_missing_path_a_file_and_a_directory_without_weights_each_have_their_message(tmp_path):
    import shutil

    from hi_na_moe.tools.commands import common as cli_common

    path, _ = _checkpoint("olmoe", tmp_path)
    missing = tmp_path / "missing"
    a_file = path / "model.safetensors"
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(path / "config.json", no_weights / "config.json")
    cases = [(missing, FileNotFoundError, r"'.*missing' does not exist"),
             (a_file, NotADirectoryError, r"'.*model.safetensors' is a file, not a checkpoint directory: pass the "
                                          r"directory that holds it \('.*olmoe'\)"),
             (no_config, FileNotFoundError, r"'.*no_config' has no config.json"),
             (no_weights, FileNotFoundError, r"'.*no_weights' has config.json but no \*.safetensors weights")]
    messages = set()
    for p, exc, want in cases:
        with pytest.raises(exc, match=want) as info:
            hi_na_moe.from_pretrained(p, weights="int8", progress=False)
        messages.add(str(info.value).replace(str(p), "PATH"))
        with pytest.raises(cli_common.UserError, match=want):
            cli_common._load(p, None)
    assert len(messages) == len(cases)
