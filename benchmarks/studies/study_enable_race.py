"""Race enable_for_model / disable_for_model against forwards on two other threads, and say how
long the process lasted and what went wrong.

Why it exists: a CI run failed with an ImportError raised inside torch.jit.is_scripting, in a
worker thread of tests/test_concurrency.py. enable_for_model then walked the other threads'
frames (sys._current_frames(), f_back, f_locals) to wait for forwards still inside a block's own
code before releasing its weights. This study reproduces what that walk did (--walk: the walk is
patched back in, as it was) and checks the code as it is now (keep_weights=True: the race the
tests run; the default releases weights, which is the caller's race, README "Guarantees").

    python benchmarks/studies/study_enable_race.py --seconds 60 --walk        # the old enable
    python benchmarks/studies/study_enable_race.py --seconds 60 --keep-weights  # enable as it is now

HINA_MOE_ISA=generic makes the forwards slower, which made the walk fail sooner. Exit status 0
when nothing went wrong; a crash of the interpreter shows as a signal (faulthandler prints the
threads' stacks).

Question: Why did enable racing forwards crash CPython 3.11, and does enable without the frame walk
  hold?
Answered in benchmarks/log/hardening.md, "enable racing forwards: the frame walk that crashed
  CPython 3.11 (2026-12-04)".
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import hi_na_moe  # noqa: E402
from hi_na_moe.integrate import patching  # noqa: E402
from tiny_models import build_tiny  # noqa: E402


def old_wait(module, gate, name, timeout):
    """enable's wait before releasing a block, as it was until the walk was removed: poll the
    other threads' stacks for a frame whose `self` is the block or one of its submodules."""
    ids = {id(m) for m in module.modules()}
    deadline, delay = time.monotonic() + timeout, 1e-4
    while True:
        with gate._cond:
            parked = set(gate.parked)
        busy = []
        me = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident == me or ident in parked:
                continue
            f = frame
            while f is not None:
                if type(f).__name__ != "frame":
                    raise AssertionError(f"the walk met a {type(f).__name__} where a frame was expected")
                code = f.f_code
                if code.co_argcount and code.co_varnames[0] == "self" and id(f.f_locals.get("self")) in ids:
                    busy.append(ident)
                    break
                f = f.f_back
        if not busy:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"gave up waiting for {name}")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to race")
    ap.add_argument("--keep-weights", action="store_true", help="enable with keep_weights=True")
    ap.add_argument("--walk", action="store_true", help="patch the old frame walk back into enable")
    args = ap.parse_args()
    faulthandler.enable()
    if args.walk:
        gates = []  # the gate of the enable at work (held as the writer while it releases)

        class RecordingGate(patching._Gate):
            def __init__(self):
                super().__init__()
                gates[:] = [self]

        original = patching.ops.NativeExperts.release

        def release_after_walk(self, module, rebuild):
            old_wait(module, gates[-1], "block", patching.DRAIN_TIMEOUT_S)
            return original(self, module, rebuild)

        patching._Gate = RecordingGate
        patching.ops.NativeExperts.release = release_after_walk

    model = build_tiny("olmoe", seed=0).model
    ids = torch.randint(0, 200, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    stop = threading.Event()
    errors: list[str] = []
    counts = [0, 0]

    def work(k: int) -> None:
        try:
            while not stop.is_set():
                with torch.no_grad():
                    out = model(ids).logits
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
                counts[k] += 1
        except BaseException:  # noqa: BLE001 - reported below
            errors.append(traceback.format_exc())
            stop.set()

    workers = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(2)]
    for w in workers:
        w.start()
    t0, cycles, main_error = time.monotonic(), 0, None
    try:
        while time.monotonic() - t0 < args.seconds and not stop.is_set():
            hi_na_moe.enable_for_model(model, keep_weights=args.keep_weights)
            hi_na_moe.disable_for_model(model)
            cycles += 1
    except BaseException:  # noqa: BLE001 - reported below
        main_error = traceback.format_exc()
    stop.set()
    for w in workers:
        w.join(60)
    print(f"walk={args.walk} keep_weights={args.keep_weights}: {time.monotonic() - t0:.1f} s, {cycles} enable/disable "
          f"cycles, {sum(counts)} forwards, {len(errors)} forward error(s), main thread error: {main_error is not None}")
    for e in errors[:1] + ([main_error] if main_error else []):
        print(e.strip().splitlines()[-1])
    return 1 if errors or main_error else 0


if __name__ == "__main__":
    sys.exit(main())
