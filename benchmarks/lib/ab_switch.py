"""In-process A/B of hi_na_moe's small-module patches (scope="all"): switch the modules a report
lists under `kind` ("norms", "routers", "attention": with the latent attention modules) between hi_na_moe's forward and their own.
Used by bench_decode_breakdown.py and bench_long_context.py (run as scripts from this folder)."""
from __future__ import annotations


def small_module_switch(model, kind: str):
    """A function use(native: bool) that puts the `kind` modules of an enabled model on
    hi_na_moe's forward (True) or on their own (False). Exits with a message if none is patched."""
    import hi_na_moe

    rep = hi_na_moe.report_for(model)
    mods = dict(model.named_modules())
    # "attention" takes the latent attention (MLA) modules too (hi_na_moe.fastpath.mla)
    names = (getattr(rep, kind) + (rep.attention_latent if kind == "attention" else [])) if rep else []
    patched = {mods[n]: mods[n].__dict__["forward"] for n in names}
    if not patched:
        raise SystemExit(f"--ab-{kind}: none of this model's {kind} runs on the native kernels (scope all?)")

    def use(native: bool) -> None:
        for m, fwd in patched.items():
            if native:
                m.forward = fwd
            else:
                m.__dict__.pop("forward", None)

    return use
