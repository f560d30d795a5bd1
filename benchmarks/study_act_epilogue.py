"""What the activation epilogue costs the prefill kernels: one OLMoE-shaped MoE layer (E64 H2048
I1024 top-8, bf16, T=512, 2 threads), packed for the avx2 and avx512 tiers, run with SiLU and
with ReLU (whose epilogue costs next to nothing), alternating; medians of 7 rounds.

    chrt -f 1 python benchmarks/study_act_epilogue.py
"""
import torch, time, statistics
from hi_na_moe import _native
E,H,I,K,T=64,2048,1024,8,512
g=torch.Generator().manual_seed(0)
def t(*s): return (torch.randn(*s,generator=g)*0.02).bfloat16()
packs={isa:_native.PackedExperts(t(E,I,H),t(E,I,H),t(E,H,I),isa=isa) for isa in ("avx2","avx512")}
x=torch.randn(T,H,generator=g).bfloat16(); idx=torch.stack([torch.randperm(E,generator=g)[:K] for _ in range(T)]).int(); w=torch.rand(T,K,generator=g)
out=torch.empty(T,H,dtype=torch.bfloat16)
res={}
for r in range(8):
    for isa,pe in packs.items():
        for act in ("silu","relu"):
            t0=time.perf_counter(); n=pe.forward(x,idx,w,out,num_threads=2,path="prefill",act=act); dt=time.perf_counter()-t0
            if r: res.setdefault((isa,act,n),[]).append(dt)
for k,v in res.items(): print(k, f"{statistics.median(v)*1e3:.1f} ms")
