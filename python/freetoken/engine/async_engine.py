"""Asyncio front of the engine: a background thread steps `LLMEngine`; requests stream their chunks back.

The engine thread owns the `LLMEngine` (nothing else touches it); the event loop talks to it through a command
queue (add, abort) and receives chunks through per-request asyncio queues fed with `call_soon_threadsafe`. New
requests therefore join the running batch between two steps, and an abandoned stream aborts its request.

Backpressure: a stream whose reader falls `stream_buffer_chunks` behind has its request paused (out of the
batch, its KV blocks kept: `Scheduler.pause`) until half is read, so a client that stops reading holds at most
that many chunks; paused for `stream_pause_timeout_s`, the request is aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from freetoken.engine.llm_engine import LLMEngine, RequestError
from freetoken.engine.resize import ResizeConflict, ResizeError, resize
from freetoken.engine.types import GenerationChunk, SamplingParams
from freetoken.heap import release_free_memory

log = logging.getLogger(__name__)

# Seconds the engine stays idle after work before it gives freed memory back to the system (a collection and a
# heap trim: tens of ms, so not between two requests of a steady load).
IDLE_TRIM_AFTER_S = 2.0


@dataclass
class _Add:
    """A new request, and its stream's state.

    Backpressure (`AsyncEngine`): `delivered` is written by the engine thread only and `consumed` by the event
    loop only, so their difference (chunks queued, unread) needs no lock. The engine thread sets `paused` before
    it reads `consumed` again, the reader counts before it reads `paused`: one of the two always sees the other
    (the GIL orders them), so a pause is never left in place once the reader has drained the queue.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    group: str | None = None
    delivered: int = 0
    consumed: int = 0
    paused: bool = False
    paused_at: float = 0.0
    resume_asked: bool = False


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Resume:
    request_id: str


@dataclass
class _Resize:
    """A cache resize (`freetoken.engine.resize.resize`'s keyword arguments) and the future of its answer."""

    sizes: dict
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


class _Stop:
    pass


class AsyncEngine:
    """Streams generations from an `LLMEngine` running on its own thread.

    Attributes:
        tokenizer: the model's tokenizer (None when the directory has none).
        model_name: the name served in the APIs.
        max_model_len: context length in tokens.
        max_request_output_tokens: most output tokens one API request may ask for over its choices.
        grammars: compiles grammars into matchers for `SamplingParams.grammar` (None without a tokenizer);
            thread-safe, blocking: call it off the event loop.
    """

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        # Backpressure: past `buffer_chunks` unread chunks a stream's request is paused, and resumed once half
        # are read; paused for `pause_timeout_s`, it is aborted.
        self.buffer_chunks = engine.cfg.stream_buffer_chunks
        self.pause_timeout_s = engine.cfg.stream_pause_timeout_s
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.max_request_output_tokens = engine.cfg.max_request_output_tokens
        self.grammars = engine.grammars
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._thread: threading.Thread | None = None
        self._stats: dict = engine.stats()
        self._resizing = False  # a cache resize is queued or running (event loop only)

    async def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="freetoken-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread after the current step; running requests end with finish_reason "abort"."""
        if self._thread is not None:
            self._commands.put(_Stop())
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            # Requests queued behind the stop were never seen by the engine thread: end them too.
            aborted = GenerationChunk(text="", token_ids=[], finish_reason="abort")
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Add):
                    command.loop.call_soon_threadsafe(command.out.put_nowait, aborted)
                elif isinstance(command, _Resize):
                    _settle(command, RuntimeError("the server is shutting down; the cache resize was not done"))

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """`LLMEngine.check_request`, from the event loop: what `generate` would refuse, found before it runs.

        Raises:
            RequestError: the message starts with the field at fault.
        """
        self.engine.check_request(prompt_ids, params)

    def estimate_prefix_reuse(self, prompt_ids: list[int]) -> tuple[int, int]:
        """(prompt tokens the prefix cache would supply, tokens the request would add to it) if `prompt_ids` were
        admitted now: an estimate, for what must be said before the engine admits the request (Anthropic's
        message_start); the chunks carry the counts at admission (`Scheduler.estimate_reuse`)."""
        return self.engine.scheduler.estimate_reuse(prompt_ids)

    def stats(self) -> dict:
        """The latest engine counters (JSON-able), as of the last step."""
        return dict(self._stats)

    @property
    def resizing(self) -> bool:
        """Whether a cache resize is queued or running."""
        return self._resizing

    async def resize_cache(self, **sizes) -> dict:
        """Resize the expert-slot cache and/or the KV cache at the engine thread's next safe point, between two
        steps (`freetoken.engine.resize.resize`; `sizes` are its keyword arguments); requests wait meanwhile.

        Returns its answer. Raises ResizeConflict when a resize is already queued or running, and what `resize`
        raises (ResizeRefused before anything changed, ResizeRolledBack after an allocation failed). Cancelling the
        caller does not cancel the resize, and the next one is refused until it has ended.
        """
        if self._resizing:
            raise ResizeConflict("a cache resize is already running; retry when it has ended")
        self._resizing = True
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        done.add_done_callback(lambda _: setattr(self, "_resizing", False))
        if self._thread is None:
            await self.start()
        self._commands.put(_Resize(sizes, loop, done))
        return await asyncio.shield(done)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, group: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Generate for one prompt, yielding chunks as tokens arrive; the last has a finish_reason.

        `group`: the API request this one is a choice of (see `LLMEngine.add_request`).

        Leaving the loop early, `aclose()` or cancelling the task aborts the request and frees its KV blocks.

        Raises:
            RequestError: the engine refused the request (message names the field).
            RuntimeError: the engine failed while running it.
        """
        if self._thread is None:
            await self.start()
        request_id = request_id or uuid.uuid4().hex
        out: asyncio.Queue = asyncio.Queue()
        stream = _Add(request_id, list(prompt_ids), params, asyncio.get_running_loop(), out, group)
        self._commands.put(stream)
        finished = False
        try:
            while True:
                item = await out.get()
                stream.consumed += 1
                if stream.paused and not stream.resume_asked and self._unread(stream) <= self.buffer_chunks // 2:
                    stream.resume_asked = True
                    self._commands.put(_Resume(request_id))
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    @staticmethod
    def _unread(stream: _Add) -> int:
        return stream.delivered - stream.consumed

    def _deliver(self, request_id: str, item: GenerationChunk | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        final = isinstance(item, BaseException) or item.finish_reason is not None
        if final:
            del self._streams[request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.engine.abort(request_id)
            return
        stream.delivered += 1
        if not final and not stream.paused and self._unread(stream) >= self.buffer_chunks:
            stream.paused, stream.paused_at = True, time.monotonic()
            self.engine.pause(request_id)
            if self._unread(stream) <= self.buffer_chunks // 2:  # the reader drained it meanwhile (see `_Add`)
                self._resume(stream)

    def _resume(self, stream: _Add) -> None:
        stream.paused = stream.resume_asked = False
        self.engine.resume(stream.request_id)

    def _expire_paused(self) -> float | None:
        """Abort the requests paused for `pause_timeout_s`; return the seconds until the next one expires (None
        when none is paused)."""
        now = time.monotonic()
        next_s = None
        for request_id, stream in list(self._streams.items()):
            if not stream.paused:
                continue
            left = stream.paused_at + self.pause_timeout_s - now
            if left > 0:
                next_s = left if next_s is None else min(next_s, left)
                continue
            log.info("request %s: its client read nothing for %.0f s; aborted", request_id, self.pause_timeout_s)
            self.engine.abort(request_id)
            self._deliver(request_id, GenerationChunk(text="", token_ids=[], finish_reason="abort"))
            self._stats = self.engine.stats()  # the loop may now wait for a command: show the blocks freed
        return next_s

    def _handle(self, command: object) -> bool:
        """Apply one command; False when the loop must stop."""
        if isinstance(command, _Stop):
            return False
        if isinstance(command, _Add):
            if command.request_id in self._streams:  # refuse it without taking over the running request's stream
                error = RequestError(f"request_id {command.request_id!r} is already running")
                command.loop.call_soon_threadsafe(command.out.put_nowait, error)
                return True
            self._streams[command.request_id] = command
            try:
                self.engine.add_request(command.request_id, command.prompt_ids, command.params, command.group)
            except Exception as e:
                self._deliver(command.request_id, e)
        elif isinstance(command, _Abort):
            self._streams.pop(command.request_id, None)
            self.engine.abort(command.request_id)
        elif isinstance(command, _Resume):
            stream = self._streams.get(command.request_id)
            if stream is not None and stream.paused:
                self._resume(stream)
        elif isinstance(command, _Resize):
            # Between two steps: the step in flight has ended; running and queued requests wait for this.
            try:
                answer: dict | BaseException = resize(self.engine, **command.sizes)
            except Exception as e:
                if not isinstance(e, ResizeError):
                    log.exception("cache resize failed")
                answer = e
            _settle(command, answer)
            self._stats = self.engine.stats()
        return True

    def _loop(self) -> None:
        if self.engine.device.type == "cuda" and self.engine.device.index is not None:
            torch.cuda.set_device(self.engine.device)  # per thread: Triton launches on the current device
        trim_due = False  # work ran since the heap was last trimmed
        while True:
            # Idle but for paused requests: wake up when the first of them expires; idle after work: wake up after
            # IDLE_TRIM_AFTER_S to give the burst's freed memory back (`freetoken.heap`).
            wait_s = self._expire_paused()
            if trim_due:
                wait_s = IDLE_TRIM_AFTER_S if wait_s is None else min(wait_s, IDLE_TRIM_AFTER_S)
            block = not self.engine.has_work()
            try:
                while True:
                    if not self._handle(self._commands.get(block=block, timeout=wait_s if block else None)):
                        self._fail_all(None)
                        return
                    block = False
            except queue.Empty:
                if block and trim_due and not self.engine.has_work():
                    self.engine.idle()
                    release_free_memory()
                    trim_due = False
            if not self.engine.has_work():
                self._stats = self.engine.stats()  # after aborts, so an idle engine reports itself idle
                continue
            trim_due = True
            try:
                outputs = self.engine.step()
            except Exception as e:  # keep serving: fail the requests of this batch, not the server
                log.exception("engine step failed")
                self._fail_all(RuntimeError(f"engine step failed: {e}"))
                continue
            for o in outputs:
                self._deliver(o.request_id, o.chunk)
            self._stats = self.engine.stats()

    def _fail_all(self, error: BaseException | None) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._deliver(
                request_id,
                error if error is not None else GenerationChunk(text="", token_ids=[], finish_reason="abort"),
            )


def _settle(command: _Resize, answer: dict | BaseException) -> None:
    """Hand a resize's answer (or exception) to its future on the event loop (nothing when the loop is closed)."""

    def settle() -> None:
        if command.done.done():
            return
        if isinstance(answer, BaseException):
            command.done.set_exception(answer)
        else:
            command.done.set_result(answer)

    try:
        command.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the event loop is closed: nobody is waiting
        pass
