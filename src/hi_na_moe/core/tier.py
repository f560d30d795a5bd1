"""The memory tier: expert blocks whose packed experts exceed `memory_limit` (HinaConfig).

When the packed experts of every accelerated block fit the limit, nothing changes. When they
do not, enable creates one native ExpertTier (csrc/include/hina_moe/tier.h): a fixed pool of
expert slots in memory of its own, sized to the limit, and every expert block is loaded
"tiered": its header and biases in memory, its experts read from the packed-expert store's file
into slots when its routers choose them (and ahead of that, when the next layers' routers
applied to the current hidden state predict them). Kernels never read the store's files.

What is in memory, and counted against the limit: the slot pool and the blocks' biases. What the
process holds besides (dense weights, embeddings, KV cache) is not: `plan` reports it so a user
can size the limit.

Every expert region is checked against a CRC-32C recorded in its store entry's metadata
(`tier_crc32c`, written with the entry; for entries written before, computed once at load from
the entry, whose every byte the store's full verification checks then).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .limits import format_bytes
from .store import CorruptEntry

# prediction reads top-k + PREDICTION_EXTRA experts of each layer ahead: on the real routing of
# an OLMoE-granular model (E64 top-8, benchmarks/log/memory-tier.md, 2026-12-07) a later layer's
# router applied to an earlier layer's MoE input reached 80 % recall one layer ahead with 0-8
# extra experts depending on the layer, 4 covering two of three
PREDICTION_EXTRA = 4
# the eviction policy shipped: freq-decay (a use weighs half after HALF_LIFE_TOKENS tokens). In the
# tier, inside the trained E64 model decoding held-out text with prediction on
# (benchmarks/studies/study_tier_trained.py; benchmarks/log/memory-tier.md, 2026-12-07), it hit
# 90.9 / 76.1 / 49.4 % of demanded experts with 50 / 30 / 10 % of them held, where lru hit 87.0 /
# 70.4 / 36.1 %, and read 35 / 22 / 14 % fewer experts a token; lfu was level with it, lru-2
# between. On random-weight OLMoE-1B-7B (int4, 25 and 50 % held) it decoded 1.10-1.13x slower than
# lru: such routers pick nearly the same experts at every token, recency's best case, which
# trained routers are not.
DEFAULT_POLICY = "freq-decay"
HALF_LIFE_TOKENS = 32.0
# an expert whose last read ahead was evicted unused is not read ahead again until it is used
# (csrc/experts/tier.cpp, Layer::wasted); experimental "tier.skip_unused_reads=off" reads it again
SKIP_UNUSED_READS = True
# refine: each layer's output (the residual stream after its MoE add) through the next layers'
# pre-router RMSNorms predicts their experts again (ExpertTier.layer_done). In the tier, on the
# E64 model's routing, it lifts layer 1's recall from 0.68-0.73 to 0.88-0.91 and layer 2's to
# 0.76-0.85 at 10-50 % held; on random-weight OLMoE at 25 % held it reads ~17 % more a token and
# decodes ~5 % slower (benchmarks/log/memory-tier.md, "Refine", 2026-12-08); experimental
# "tier.refine=off" predicts only at acquire
REFINE = True


class TierConfigError(ValueError):
    """memory_limit cannot hold what the model needs at least."""


@dataclass
class BlockSize:
    name: str
    experts: int
    top_k: int | None
    gu_bytes: int
    down_bytes: int
    bias_bytes: int

    @property
    def expert_bytes(self) -> int:
        return self.gu_bytes + self.down_bytes

    @property
    def packed_bytes(self) -> int:
        return self.experts * self.expert_bytes + self.bias_bytes


def block_size(native, name: str, spec, isa: str, weights: str, group_size: int, top_k: int | None) -> BlockSize:
    """What packing `spec` in `weights` gives, from the packed header alone (nothing is packed)."""
    dtype = str(spec.weight_dtype).removeprefix("torch.")
    has_gb = spec.gate_up_bias is not None
    h = native.PackedExperts.plan(dtype, spec.num_experts, spec.hidden, spec.intermediate, spec.has_gate,
                                  gate_bias=has_gb and spec.has_gate, up_bias=has_gb, down_bias=spec.down_bias is not None,
                                  isa=isa, weights=weights, group_size=group_size)
    info = native.header_info(h)
    gu, dn, E = int(info["gu_expert_bytes"]), int(info["down_expert_bytes"]), int(info["E"])
    return BlockSize(name, E, top_k, gu, dn, int(info["nbytes"]) - E * (gu + dn))


@dataclass
class TierPlan:
    limit: int
    blocks: list[BlockSize]
    slot_bytes: int = 0
    num_slots: int = 0
    active: bool = False
    why: str = ""

    @property
    def experts_bytes(self) -> int:
        return sum(b.packed_bytes for b in self.blocks)


def plan(native, blocks: list[BlockSize], limit: int | None) -> TierPlan | None:
    """None without a limit; else the plan: active when the packed experts exceed the limit.
    Raises TierConfigError when the limit cannot hold one token's experts of the widest layer."""
    if limit is None or not blocks:
        return None
    p = TierPlan(limit, blocks)
    total = p.experts_bytes
    if total <= limit:
        p.why = f"the packed experts ({format_bytes(total)}) fit memory_limit ({format_bytes(limit)}): all in memory"
        return p
    p.slot_bytes = max(int(native.tier_slot_bytes(b.gu_bytes, b.down_bytes)) for b in blocks)
    biases = sum(b.bias_bytes for b in blocks)
    need_k = max((b.top_k or b.experts) for b in blocks)
    minimum = biases + need_k * p.slot_bytes
    if limit < minimum:
        raise TierConfigError(
            f"memory_limit {format_bytes(limit)} ({limit} bytes) is too small for these experts: the memory tier needs "
            f"at least {format_bytes(minimum)} ({minimum} bytes: the {need_k} experts one token routes to in a layer, "
            f"{format_bytes(p.slot_bytes)} a slot, plus {format_bytes(biases)} of biases); the packed experts take "
            f"{format_bytes(total)} in all")
    p.num_slots = (limit - biases) // p.slot_bytes
    p.active = True
    p.why = (f"the packed experts ({format_bytes(total)}) exceed memory_limit ({format_bytes(limit)}): "
             f"{p.num_slots} expert slots of {format_bytes(p.slot_bytes)} in memory, the rest read from the store")
    return p


def policy_of(cfg) -> str:
    """The eviction policy config key `eviction` names; its "auto" is DEFAULT_POLICY."""
    name = getattr(cfg, "eviction", "auto")
    return DEFAULT_POLICY if name == "auto" else name


def make_tier(native, p: TierPlan, cfg, num_layers: int, fault: dict | None = None):
    """The native ExpertTier for an active plan."""
    direct = {"auto": True, "on": True, "off": False}[getattr(cfg, "direct_io", "auto")]
    window = getattr(cfg, "prediction_window", 2) if getattr(cfg, "prefetch", True) else 0
    return native.ExpertTier(p.slot_bytes, p.num_slots, io_threads=getattr(cfg, "io_threads", 4), direct_io=direct,
                             policy=policy_of(cfg), half_life=HALF_LIFE_TOKENS * max(1, num_layers),
                             prediction_window=window, prediction_extra=PREDICTION_EXTRA,
                             skip_unused_reads=SKIP_UNUSED_READS, refine=REFINE, **(fault or {}))


def expert_crcs(native, block, info: dict) -> dict[str, Any]:
    """CRC-32C of each expert's gate/up and down regions of a packed block (uint8 array)."""
    E, gu, dn = int(info["E"]), int(info["gu_expert_bytes"]), int(info["down_expert_bytes"])
    base = E * gu
    return {"gate_up": [int(native.crc32c(block[e * gu:(e + 1) * gu])) for e in range(E)],
            "down": [int(native.crc32c(block[base + e * dn:base + (e + 1) * dn])) for e in range(E)],
            "rest": int(native.crc32c(block[E * (gu + dn):]))}


def load_tiered(native, entry, tier):
    """A PackedExperts over `entry`'s block whose experts live in `tier` (registered as its next
    layer); the entry is closed. Returns (PackedExperts, layer id)."""
    try:
        header = bytes.fromhex(entry.meta["header"])
        info = native.header_info(header)
        block = entry.array("block", "uint8")
        crcs = entry.meta.get("tier_crc32c") or expert_crcs(native, block, info)
        E, gu, dn = int(info["E"]), int(info["gu_expert_bytes"]), int(info["down_expert_bytes"])
        rest = block[E * (gu + dn):]
        if int(native.crc32c(rest)) != int(crcs["rest"]):
            raise CorruptEntry(entry.path, "the block's bias region does not match its recorded CRC-32C")
        off = entry.offsets["block"]
        layer = tier.add_layer(str(entry.path), E, off, gu, off + E * gu, dn, crcs["gate_up"], crcs["down"])
        pe = native.packed_tiered(header, tier, layer, rest.copy())
        del block, rest
    finally:
        entry.close()
    return pe, layer


@dataclass
class TierState:
    """What enable set up: the tier, its plan, the layers' names, what the report shows."""
    tier: Any
    plan: TierPlan
    layer_names: dict[int, str] = field(default_factory=dict)
    predicting: set = field(default_factory=set)  # layers with a router registered
    refining: set = field(default_factory=set)  # of them, layers with their pre-router RMSNorm too (refine)
    # tier layer -> the decoder layer whose output is its residual stream (refine's forward hooks)
    decoder_layers: dict = field(default_factory=dict)
    hooks: list = field(default_factory=list)  # refine's forward hook handles, removed on disable
    refine_sources: set = field(default_factory=set)  # layers whose output is handed to layer_done
    numa: Any = None  # hi_na_moe.core.numa.BindStatus when numa_node is set
    other_bytes: int | None = None  # the model's weights outside the tiered experts
    prior_note: str | None = None  # what the profile (HinaConfig.profile) did, for the report

    def stats(self) -> dict[str, Any]:
        return stats_dict(self.tier.stats(), self)


def stats_dict(raw: dict, state: TierState | None = None) -> dict[str, Any]:
    """The counters of hi_na_moe.stats(model): hits, misses, bytes_read, prefetch_precision,
    prefetch_recall, io_wait_s, ... and per layer. Recall is over the layers a prediction can
    reach (not the first, and only layers whose router prediction reads)."""
    layers = raw["layers"]
    reach = [i for i in range(len(layers)) if state is None or i in state.predicting]
    reach = [i for i in reach if i > 0]
    used = sum(layers[i]["predicted_used"] for i in reach)
    pred = sum(layers[i]["predicted"] for i in reach)
    dem = sum(layers[i]["demanded"] for i in reach)
    out = {k: v for k, v in raw.items() if k != "layers"}
    acc = raw["hits"] + raw["misses"]
    out.update(
        hit_rate=raw["hits"] / acc if acc else None,
        prefetch_precision=used / pred if pred else None,
        prefetch_recall=used / dem if dem else None,
        layers=[dict(l, name=(state.layer_names.get(i) if state else None),
                     hit_rate=l["hits"] / (l["hits"] + l["misses"]) if l["hits"] + l["misses"] else None,
                     recall=(l["predicted_used"] / l["demanded"]) if (l["demanded"] and i in reach) else None,
                     precision=(l["predicted_used"] / l["predicted"]) if l["predicted"] else None)
                for i, l in enumerate(layers)],
    )
    return out


PRIOR_FORMAT = "hi_na_moe.expert_prior"  # profile-router's expert_prior.json (tools/profile_router.py)


def read_prior(path: str) -> dict[str, list[float]]:
    """{block name: each expert's share of its block's routed slots} from `path`: profile-router's
    output directory or its expert_prior.json. TierConfigError names the file and what is wrong."""
    p = Path(path).expanduser()
    f = p / "expert_prior.json" if p.is_dir() else p
    if not f.is_file():
        raise TierConfigError(f"profile {str(path)!r}: no {'expert_prior.json in that directory' if p.is_dir() else 'such file'}"
                              " (hi-na-moe profile-router --out DIR writes DIR/expert_prior.json)")
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TierConfigError(f"profile {str(f)!r} cannot be read as JSON ({exc})") from None
    if not isinstance(d, dict) or d.get("format") != PRIOR_FORMAT or not isinstance(d.get("blocks"), list):
        raise TierConfigError(f"profile {str(f)!r} is not an expert prior (format {PRIOR_FORMAT!r}, written by "
                              "hi-na-moe profile-router)")
    out = {}
    for b in d["blocks"]:
        freq = b.get("frequency") if isinstance(b, dict) else None
        if not isinstance(b, dict) or not isinstance(b.get("block"), str) or not isinstance(freq, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in freq):
            raise TierConfigError(f"profile {str(f)!r}: a block entry without a name and a list of frequencies >= 0")
        out[b["block"]] = [float(v) for v in freq]
    return out


def warm_order(prior: dict[str, list[float]], layers: dict[int, str], experts: dict[int, int], slots: int,
               source: str) -> list[tuple[int, int]]:
    """The (tier layer, expert) pairs a pool of `slots` starts with: the prior's most frequent
    experts over all layers, the least frequent of them first (so that a recency policy keeps the
    most frequent longest). `layers`: tier layer -> block name; `experts`: tier layer -> E."""
    picks = []
    for layer, name in layers.items():
        freq = prior.get(name)
        if freq is None:
            raise TierConfigError(f"profile {source!r} has no block {name!r}: it was written for another model "
                                  f"(its blocks: {', '.join(list(prior)[:3])}{', ...' if len(prior) > 3 else ''})")
        if len(freq) != experts[layer]:
            raise TierConfigError(f"profile {source!r}: block {name!r} has {len(freq)} experts there, "
                                  f"{experts[layer]} in this model")
        picks += [(v, layer, e) for e, v in enumerate(freq) if v > 0]
    picks.sort(key=lambda t: (-t[0], t[1], t[2]))
    return [(layer, e) for _, layer, e in reversed(picks[:slots])]
