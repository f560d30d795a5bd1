"""Continuous batching over a transformers causal LM: the loop behind `hi-na-moe serve`.

One thread owns the model. Each turn of its loop does, in order:
1. admits queued requests while the batch has room (`max_batch` sequences decoding or prefilling);
2. runs one prefill chunk (at most `prefill_chunk` prompt tokens) of the oldest admitted prompt,
   in that sequence's own cache, so a long prompt costs the running batch one chunk a turn, not
   its whole length at once;
3. runs one decode step for every sequence that is decoding: one model call on [B, 1] tokens;
4. retires the finished and the cancelled sequences; their cache rows go at once.

The batch's cache is one transformers DynamicCache with a row per decoding sequence. Rows are
aligned on the right: a sequence shorter than the longest is padded on the left, and its padding
is masked (a 2-D attention mask) while position_ids give each row its own positions, as
generate() does for a left-padded batch. So the model's own forward computes each row as it
would alone (up to the rounding of a batched matrix product), and hi_na_moe's batched decode
step takes the call as it takes generate()'s. A prompt that finished prefilling joins with one
copy of the batch's cache (its rows padded to the new length when the prompt is the longest);
retiring rows copies the rest once and drops the columns that only padding held.

The sampling of a row is the request's: greedy at temperature 0, else temperature then top-p
then a draw from the request's own generator (seeded when the request gives a seed), so a
request's tokens do not depend on what else is in the batch.

Text: each sequence decodes its tokens incrementally (the last few tokens again, so a character
split over tokens is emitted whole), and holds back the text that could still become one of its
stop strings; a stop string ends the sequence and is not part of its text.

Nothing here is HTTP: hi_na_moe.serve.app puts the OpenAI routes on top; tests drive the engine
directly.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

_log = logging.getLogger("hi_na_moe.serve")

__all__ = ["Engine", "EngineError", "QueueFull", "Sequence", "SamplingParams", "Event"]


class EngineError(RuntimeError):
    """The engine cannot run this model, or was stopped."""


class QueueFull(RuntimeError):
    """The queue already holds max_queue requests: the server answers 429."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class Event:
    """What a sequence reports to its caller, once a token: `text` new since the last event (empty
    while a token's characters are incomplete or may begin a stop string) and `tokens`, the new
    tokens (1, or 0 for an end-of-sequence token); a last event has `finish` set ("stop", "length", "cancelled",
    or "error" with `error` saying why)."""

    text: str = ""
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


_ids = itertools.count(1)


class Sequence:
    """One request in the engine: its prompt, its sampling, its state and its cache until it joins."""

    def __init__(self, prompt: list[int], params: SamplingParams, emit: Callable[[Event], None]):
        self.id = next(_ids)
        self.prompt = list(prompt)
        self.params = params
        self.emit = emit
        self.cancelled = False
        self.out: list[int] = []
        self.done = False
        self.prefilled = 0  # prompt tokens in self.cache
        self.cache: DynamicCache | None = None  # its own, while it prefills
        self.length = 0  # tokens in the cache (its next position)
        self.created = time.monotonic()
        self.first_token_at: float | None = None
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()  # (a non-deterministic seed)
        # incremental detokenising (_Text)
        self.text = _Text(params.stop)

    def cancel(self) -> None:
        """The caller went away: the engine drops the sequence at its next turn (thread-safe: a flag)."""
        self.cancelled = True


class _Text:
    """A sequence's text as its tokens arrive, with its stop strings held back."""

    __slots__ = ("stop", "hold", "prefix", "read", "text", "sent")

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.prefix = self.read = 0  # token offsets: decode from prefix, text before read is final
        self.text = ""  # final text so far
        self.sent = 0  # characters of text already emitted

    def add(self, tokenizer, ids: list[int], final: bool) -> tuple[str, bool]:
        """(text to emit now, whether a stop string ended the sequence) after ids[-1] arrived."""
        full = tokenizer.decode(ids[self.prefix:], skip_special_tokens=True)
        head = tokenizer.decode(ids[self.prefix:self.read], skip_special_tokens=True) if self.read > self.prefix else ""
        if len(full) > len(head) and not full.endswith("\ufffd"):
            self.text += full[len(head):]
            self.prefix, self.read = self.read, len(ids)
        elif final and len(full) > len(head):  # the last tokens end inside a character: emit what there is
            self.text += full[len(head):]
        if self.stop:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                out = self.text[self.sent:cut]
                self.text, self.sent = self.text[:cut], cut
                return out, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self._partial())
        out = self.text[self.sent:end]
        self.sent = end
        return out, False

    def _partial(self) -> int:
        """Characters at the end of the text that begin a stop string (held back until they don't)."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best


@dataclass
class Counters:
    """What /metrics reports; the engine thread writes, readers read (ints and floats: no lock)."""

    requests: int = 0
    finished: collections.Counter = field(default_factory=collections.Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    step_rows: int = 0
    prefill_chunks: int = 0
    rejected: int = 0
    step_seconds: float = 0.0
    prefill_seconds: float = 0.0
    cache_seconds: float = 0.0  # rows joining and leaving the batch's cache (copies)
    idle_trims: int = 0  # malloc_trim calls when the engine ran out of work (see Engine.trim_when_idle)
    trim_seconds: float = 0.0
    ttft: list = field(default_factory=list)  # (recent) seconds from arrival to first token
    tokens_window: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))


class Engine:
    """Continuous batching for `model` (a transformers causal LM in eval mode on the CPU, enabled
    or not) with `tokenizer`; see the module docstring. Thread-safe `submit`; `start` runs the loop
    in its own thread, `stop` ends it (after the sequences in flight when drain=True)."""

    def __init__(self, model, tokenizer, *, max_batch: int = 16, max_queue: int | None = None,
                 prefill_chunk: int = 64, max_context: int | None = None, eos_token_ids=None,
                 trim_when_idle: bool = True):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch = max_batch
        self.max_queue = max_queue if max_queue is not None else 4 * max_batch
        self.prefill_chunk = prefill_chunk
        cfg = model.config
        limit = getattr(cfg, "max_position_embeddings", None) or 4096
        self.max_context = min(max_context, limit) if max_context else limit
        self.eos = set(eos_token_ids if eos_token_ids is not None else _eos_ids(model, tokenizer))
        head = model.get_output_embeddings()
        self.vocab = head.weight.shape[0] if head is not None else getattr(cfg, "vocab_size", None)
        self.counters = Counters()
        self._cond = threading.Condition()
        self._queue: collections.deque[Sequence] = collections.deque()
        self._prefilling: list[Sequence] = []
        self._rows: list[Sequence] = []  # decoding, in the batch cache's row order
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [B, T] long: 1 where a row holds a real position
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self.failure: str | None = None  # why the loop died, if it did
        # glibc keeps the heap pages a burst of requests freed; handing them back when the queue
        # empties keeps an idle server's RSS at its working set (benchmarks/log/serving.md: the
        # soak's idle RSS, 484-530 MB, was 434-457 MB after malloc_trim). Only ever between
        # requests, never in a step; None where the C library has no malloc_trim (not glibc).
        self._trim = _malloc_trim() if trim_when_idle else None
        self._worked = False  # a step ran since the last trim

    # -- the caller's side ----------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, emit: Callable[[Event], None]) -> Sequence:
        """Queue a request; `emit` is called from the engine thread with each Event. Raises
        QueueFull when max_queue requests already wait, EngineError when stopped or failed, and
        ValueError for a prompt the engine cannot take (empty, too long, ids out of range)."""
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) is more than "
                             f"the context this server allows ({self.max_context} tokens): shorten the prompt or "
                             "lower max_tokens")
        if self.vocab is not None and (min(prompt) < 0 or max(prompt) >= self.vocab):
            bad = next(t for t in prompt if t < 0 or t >= self.vocab)
            raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{self.vocab - 1})")
        seq = Sequence(prompt, params, emit)
        with self._cond:
            if self.failure is not None:
                raise EngineError(f"the engine stopped after an error: {self.failure}")
            if not self._accepting:
                raise EngineError("the server is shutting down")
            # the places free in the batch take requests too (they wait only for the loop's next turn)
            room = self.max_queue + max(0, self.max_batch - len(self._prefilling) - len(self._rows))
            if len(self._queue) >= room:
                self.counters.rejected += 1
                raise QueueFull(f"the batch ({self.max_batch} sequences) and the queue (max_queue {self.max_queue}) "
                                "are full")
            self._queue.append(seq)
            self.counters.requests += 1
            self._cond.notify()
        return seq

    def queue_depth(self) -> int:
        return len(self._queue)

    def batch_size(self) -> int:
        return len(self._rows)

    def prefilling(self) -> int:
        return len(self._prefilling)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="hi-na-moe-engine", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with drain, finish those already submitted first, else cancel
        them. Returns when the loop has ended (or after `timeout` seconds)."""
        with self._cond:
            self._accepting = False
            if not drain:
                for s in itertools.chain(self._queue, self._prefilling, self._rows):
                    s.cancelled = True
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- warm-up --------------------------------------------------------------------------------
    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """One prefill chunk and one decode step for every batch size 1..max_batch, before the
        loop starts, so first-call set-up and page-ins are not the first users' (also checks that
        the model's cache is one this engine can batch)."""
        if self._thread is not None:
            raise EngineError("warm_up runs before start()")
        vocab = self.vocab or 2
        prompt = [i % vocab for i in range(1, min(self.prefill_chunk, self.max_context - 2) + 1)]
        with torch.inference_mode():
            seq = Sequence(prompt, SamplingParams(max_tokens=1, temperature=0.0), lambda e: None)
            self._prefill(seq)  # the whole prompt in one chunk
            self._check_cache(seq.cache)
            for b in range(1, self.max_batch + 1):
                if progress is not None:
                    progress(f"decode step at batch size {b}")
                cache = _repeat(seq.cache, b)
                ids = torch.full((b, 1), prompt[0], dtype=torch.long)
                self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                mask = torch.ones(b, seq.length + 2, dtype=torch.long)
                mask[0, 0] = 0  # a padded row: the masked path joining requests take
                pos = torch.full((b, 1), seq.length + 1, dtype=torch.long)
                self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                           attention_mask=mask, position_ids=pos)

    @staticmethod
    def _check_cache(cache) -> None:
        kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
        if kinds:
            raise EngineError(f"the model's cache has layers of kind {', '.join(sorted(kinds))}: continuous batching "
                              "here batches plain attention caches (DynamicLayer) only")

    # -- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._cond:
                        idle = not (self._queue or self._prefilling or self._rows or self._stopping)
                    if idle and self._worked and self._trim is not None:
                        t0 = time.perf_counter()
                        self._trim(0)
                        self.counters.trim_seconds += time.perf_counter() - t0
                        self.counters.idle_trims += 1
                        self._worked = False
                    with self._cond:
                        while not (self._queue or self._prefilling or self._rows or self._stopping):
                            self._cond.wait()
                        if self._stopping and not (self._queue or self._prefilling or self._rows):
                            return
                        while self._queue and len(self._prefilling) + len(self._rows) < self.max_batch:
                            self._prefilling.append(self._queue.popleft())
                        cancelled = [s for s in self._queue if s.cancelled]
                        for s in cancelled:
                            self._queue.remove(s)
                    for s in cancelled:
                        self._finish(s, "cancelled")
                    self._turn()
                    self._worked = True
        except BaseException as exc:  # the model raised: every request in flight gets the error
            why = f"{type(exc).__name__}: {exc}"
            with self._cond:
                self.failure = why
                waiting = list(itertools.chain(self._queue, self._prefilling, self._rows))
                self._queue.clear()
                self._prefilling.clear()
                self._rows.clear()
                self._cache = self._mask = None
            for s in waiting:
                self._finish(s, "error", error=why)
            _log.exception("the engine stopped: %s", why)

    def _turn(self) -> None:
        # cancelled prompts leave before their next chunk
        for s in [s for s in self._prefilling if s.cancelled]:
            self._prefilling.remove(s)
            self._finish(s, "cancelled")
        budget = self.prefill_chunk  # prompt tokens this turn: several short prompts, or one chunk of a long one
        while self._prefilling and budget > 0:
            s = self._prefilling[0]
            t0 = time.perf_counter()
            n, logits = self._prefill_chunk(s, budget)
            budget -= n
            self.counters.prefill_seconds += time.perf_counter() - t0
            self.counters.prefill_chunks += 1
            if logits is not None:  # the prompt is in: its first token
                self._prefilling.pop(0)
                if not self._accept(s, self._sample(s, logits[0])):
                    t0 = time.perf_counter()
                    self._join(s)
                    self.counters.cache_seconds += time.perf_counter() - t0
        if self._rows:
            self._decode()
        gone = [i for i, s in enumerate(self._rows) if s.done or s.cancelled]
        if gone:
            for i in gone:
                if not self._rows[i].done:
                    self._finish(self._rows[i], "cancelled")
            t0 = time.perf_counter()
            self._leave(gone)
            self.counters.cache_seconds += time.perf_counter() - t0

    def _prefill(self, seq: Sequence) -> torch.Tensor:
        """The whole prompt at once (warm-up)."""
        seq.cache = DynamicCache()
        ids = torch.tensor([seq.prompt], dtype=torch.long)
        out = self.model(input_ids=ids, past_key_values=seq.cache, use_cache=True, logits_to_keep=1)
        seq.prefilled = seq.length = len(seq.prompt)
        return out.logits[:, -1].float()

    def _prefill_chunk(self, seq: Sequence, budget: int) -> tuple[int, torch.Tensor | None]:
        """The next chunk (at most `budget` tokens) of seq's prompt into its own cache: (its
        tokens, the logits of the last prompt token once the whole prompt is in, else None)."""
        if seq.cache is None:
            seq.cache = DynamicCache()
        a = seq.prefilled
        b = min(len(seq.prompt), a + budget)
        ids = torch.tensor([seq.prompt[a:b]], dtype=torch.long)
        out = self.model(input_ids=ids, past_key_values=seq.cache, use_cache=True, logits_to_keep=1)
        seq.prefilled = seq.length = b
        self.counters.prompt_tokens += b - a
        if b < len(seq.prompt):
            return b - a, None
        self._check_cache(seq.cache)
        return b - a, out.logits[:, -1].float()

    def _decode(self) -> None:
        rows = self._rows
        B = len(rows)
        ids = torch.tensor([[s.out[-1]] for s in rows], dtype=torch.long)
        T = self._mask.shape[1]
        padded = any(s.length != T for s in rows)
        kw = {}
        if padded:
            self._mask = torch.cat([self._mask, torch.ones(B, 1, dtype=torch.long)], 1)
            kw = {"attention_mask": self._mask, "position_ids": torch.tensor([[s.length] for s in rows], dtype=torch.long)}
        else:
            self._mask = torch.ones(B, T + 1, dtype=torch.long)
        t0 = time.perf_counter()
        out = self.model(input_ids=ids, past_key_values=self._cache, use_cache=True, logits_to_keep=1, **kw)
        logits = out.logits[:, -1].float()
        c = self.counters
        c.step_seconds += time.perf_counter() - t0
        c.steps += 1
        c.step_rows += B
        # greedy rows' tokens in one call (a row's argmax as _sample takes it)
        greedy = logits.argmax(-1).tolist() if any(s.params.temperature == 0 for s in rows) else None
        for i, s in enumerate(rows):
            s.length += 1
            if s.cancelled:
                continue
            self._accept(s, greedy[i] if s.params.temperature == 0 else self._sample(s, logits[i]))

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        p = seq.params
        if p.temperature == 0:
            return int(logits.argmax())
        logits = logits / p.temperature
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, -1)
            # keep the smallest prefix whose mass reaches top_p (the first token always)
            drop = (torch.cumsum(probs, -1) - probs) >= p.top_p
            sorted_logits[drop] = float("-inf")
            logits = torch.full_like(logits, float("-inf")).scatter_(0, order, sorted_logits)
        probs = torch.softmax(logits, -1)
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def _accept(self, seq: Sequence, tok: int) -> bool:
        """Add a sampled token to seq and emit its text; whether seq is now finished."""
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
            ttft = self.counters.ttft
            ttft.append(now - seq.created)
            if len(ttft) > 4096:
                del ttft[:2048]
        self.counters.tokens_window.append(now)
        eos = tok in self.eos and not seq.params.ignore_eos
        if not eos:  # (an end-of-sequence token is not part of the completion)
            seq.out.append(tok)
            self.counters.completion_tokens += 1
        length = len(seq.out) >= seq.params.max_tokens
        text, stopped = seq.text.add(self.tokenizer, seq.out, eos or length) if seq.out else ("", False)
        if eos or stopped:
            self._finish(seq, "stop", text=text, tokens=0 if eos else 1)
        elif length:
            self._finish(seq, "length", text=text, tokens=1)
        else:  # (also without text: a token held back or without characters still counts, for usage)
            self._emit(seq, Event(text=text, tokens=1))
        return seq.done

    def _finish(self, seq: Sequence, reason: str, text: str = "", tokens: int = 0, error: str | None = None) -> None:
        if seq.done:
            return
        seq.done = True
        seq.cache = None
        self.counters.finished[reason] += 1
        self._emit(seq, Event(text=text, tokens=tokens, finish=reason, error=error, prompt_tokens=len(seq.prompt),
                              completion_tokens=len(seq.out)))

    @staticmethod
    def _emit(seq: Sequence, event: Event) -> None:
        try:
            seq.emit(event)
        except Exception:  # a caller whose side is gone (its event loop closed, ...): the sequence goes
            seq.cancelled = True

    # -- the batch's cache ----------------------------------------------------------------------
    def _join(self, seq: Sequence) -> None:
        """seq's own cache becomes the batch's last row (both padded on the left to the longer)."""
        own, seq.cache = seq.cache, None
        L = seq.length
        if not self._rows:
            self._cache, self._mask, self._rows = own, torch.ones(1, L, dtype=torch.long), [seq]
            return
        T = self._mask.shape[1]
        N = max(T, L)
        B = len(self._rows)
        for mine, theirs in zip(self._cache.layers, own.layers):
            mine.keys = _stack_left(mine.keys, theirs.keys, N)
            mine.values = _stack_left(mine.values, theirs.values, N)
        mask = torch.zeros(B + 1, N, dtype=torch.long)
        mask[:B, N - T:] = self._mask
        mask[B, N - L:] = 1
        self._mask = mask
        self._rows.append(seq)

    def _leave(self, gone: list[int]) -> None:
        out = set(gone)
        keep = [i for i in range(len(self._rows)) if i not in out]
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            return
        self._rows = [self._rows[i] for i in keep]
        mask = self._mask[keep]
        real = mask.any(0).nonzero()
        first = int(real[0]) if len(real) else 0  # columns before it: padding in every row left
        self._mask = mask[:, first:].contiguous()
        index = torch.tensor(keep, dtype=torch.long)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:].contiguous()
            layer.values = layer.values.index_select(0, index)[:, :, first:].contiguous()


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def _stack_left(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """[Ba + Bb, H, n, D]: a's rows then b's, each padded with zeros on the left to n positions."""
    out = a.new_zeros((a.shape[0] + b.shape[0], a.shape[1], n, a.shape[3]))
    out[: a.shape[0], :, n - a.shape[2]:] = a
    out[a.shape[0]:, :, n - b.shape[2]:] = b
    return out


def _repeat(cache: DynamicCache, b: int) -> DynamicCache:
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.expand(b, -1, -1, -1).contiguous(), layer.values.expand(b, -1, -1, -1).contiguous(), i)
    return out


def _eos_ids(model, tokenizer) -> list[int]:
    """The ids that end a sequence: the generation config's eos_token_id (int or list), else the
    tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
