"""Whether anything observes a module call (hooks, dispatch or function modes, compile tracing):
while something does, the native short paths leave the call to the modules' own forwards so
the observer sees every module it expects (Watch: the modules a short path skips)."""

from __future__ import annotations

import torch
from torch import nn

from ..core.torch_ops import _function_mode_on, _len_dispatch_modes


def _capture_state():
    """transformers' output-capturing hooks (utils.output_capturing): (the hook functions'
    qualified name, the context variable that holds the active collector), or None."""
    try:  # optional dependency: an internal module of transformers, which other versions may lack
        from transformers.utils import output_capturing as oc
    except ImportError:
        return None
    collector = getattr(oc, "_active_collector", None)
    if collector is None or not hasattr(collector, "get"):
        return None
    return "install_output_capuring_hook.<locals>.output_capturing_hook", collector


_CAPTURE = _capture_state()


def _idle_capture_hooks(module: nn.Module) -> bool:
    """Whether every hook on `module` is a transformers output-capturing hook and none is
    capturing now: the model's forward sets the collector to a dict of what to capture, empty
    when nothing is asked for, and the hooks then return without looking at anything."""
    if module._forward_pre_hooks or _CAPTURE is None:
        return False
    qualname, collector = _CAPTURE
    if not all(getattr(h, "__qualname__", None) == qualname for h in module._forward_hooks.values()):
        return False
    return not collector.get()


def observing() -> bool:
    """Whether something process-wide would see modules skipped: a global module hook, a
    dispatch or function mode, torch.compile tracing."""
    if (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
            or torch.compiler.is_compiling()):
        return True
    return bool(_len_dispatch_modes() or _function_mode_on())


class Watch:
    """What a short path that skips module calls compares at every call: the modules it does not
    call through __call__ with the forward each has now, and the parent-child links it found
    them by (a part replaced after enable, e.g. mlp.down_proj = another module, is not the one it
    resolved)."""

    __slots__ = ("links", "forwards", "hook_dicts", "_flat")

    def __init__(self, skipped: list[nn.Module], links: list[tuple[nn.Module, str]]):
        self.links = tuple((parent._modules, name, parent._modules[name]) for parent, name in links)
        self.forwards = tuple((mod.__dict__, mod.__dict__.get("forward")) for mod in skipped)
        self.hook_dicts = tuple((mod._forward_hooks, mod._forward_pre_hooks, mod) for mod in skipped)
        self._index()

    @classmethod
    def merged(cls, watches: list[Watch]) -> Watch:
        """One Watch comparing everything the given ones compare (a stack's, over its layers':
        one pass instead of a call each)."""
        w = cls.__new__(cls)
        w.links = tuple(x for v in watches for x in v.links)
        w.forwards = tuple(x for v in watches for x in v.forwards)
        w.hook_dicts = tuple(x for v in watches for x in v.hook_dicts)
        w._index()
        return w

    def _index(self) -> None:
        # the same comparisons as columns, for C-level passes (map over dict.get, list equality:
        # modules compare by identity; a forward equal to the one held, the same function bound
        # to the same module, is that forward)
        self._flat = (tuple(m for m, _, _ in self.links), tuple(n for _, n, _ in self.links),
                      [c for _, _, c in self.links], tuple(d for d, _ in self.forwards),
                      ("forward",) * len(self.forwards), [f for _, f in self.forwards],
                      tuple(h for hooks, pre, _ in self.hook_dicts for h in (hooks, pre)))

    def observed(self) -> bool:
        """Whether a hook, a replaced forward or a replaced part would see the skipped modules."""
        parents, names, children, dicts, keys, forwards, hook_dicts = self._flat
        if list(map(dict.get, parents, names)) != children or list(map(dict.get, dicts, keys)) != forwards:
            return True
        if any(hook_dicts):  # (a dict is true when it holds a hook)
            for hooks, pre_hooks, mod in self.hook_dicts:
                if (hooks or pre_hooks) and not _idle_capture_hooks(mod):
                    return True
        return False
