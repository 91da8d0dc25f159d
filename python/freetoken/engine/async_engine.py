"""Asyncio front of the engine: a background thread steps `LLMEngine`; requests stream their chunks back.

The engine thread owns the `LLMEngine` (nothing else touches it); the event loop talks to it through a command
queue (add, abort) and receives chunks through per-request asyncio queues fed with `call_soon_threadsafe`. New
requests therefore join the running batch between two steps, and an abandoned stream aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from freetoken.engine.llm_engine import LLMEngine, RequestError
from freetoken.engine.types import GenerationChunk, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncEngine:
    """Streams generations from an `LLMEngine` running on its own thread.

    Attributes:
        tokenizer: the model's tokenizer (None when the directory has none).
        model_name: the name served in the APIs.
        max_model_len: context length in tokens.
        grammars: compiles grammars into matchers for `SamplingParams.grammar` (None without a tokenizer);
            thread-safe, blocking: call it off the event loop.
    """

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.grammars = engine.grammars
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._thread: threading.Thread | None = None
        self._stats: dict = engine.stats()

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

    def estimate_prefix_reuse(self, prompt_ids: list[int]) -> tuple[int, int]:
        """(prompt tokens the prefix cache would supply, tokens the request would add to it) if `prompt_ids` were
        admitted now: an estimate, for what must be said before the engine admits the request (Anthropic's
        message_start); the chunks carry the counts at admission (`Scheduler.estimate_reuse`)."""
        return self.engine.scheduler.estimate_reuse(prompt_ids)

    def stats(self) -> dict:
        """The latest engine counters (JSON-able), as of the last step."""
        return dict(self._stats)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Generate for one prompt, yielding chunks as tokens arrive; the last has a finish_reason.

        Leaving the loop early, `aclose()` or cancelling the task aborts the request and frees its KV blocks.

        Raises:
            RequestError: the engine refused the request (message names the field).
            RuntimeError: the engine failed while running it.
        """
        if self._thread is None:
            await self.start()
        request_id = request_id or uuid.uuid4().hex
        out: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(request_id, list(prompt_ids), params, asyncio.get_running_loop(), out))
        finished = False
        try:
            while True:
                item = await out.get()
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

    def _deliver(self, request_id: str, item: GenerationChunk | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finish_reason is not None:
            del self._streams[request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.engine.abort(request_id)

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
                self.engine.add_request(command.request_id, command.prompt_ids, command.params)
            except Exception as e:  # noqa: BLE001 (RequestError or any other bad-request failure: the thread lives on)
                self._deliver(command.request_id, e)
        elif isinstance(command, _Abort):
            self._streams.pop(command.request_id, None)
            self.engine.abort(command.request_id)
        return True

    def _loop(self) -> None:
        if self.engine.device.type == "cuda" and self.engine.device.index is not None:
            torch.cuda.set_device(self.engine.device)  # per thread: Triton launches on the current device
        while True:
            block = not self.engine.has_work()
            try:
                while True:
                    if not self._handle(self._commands.get(block=block)):
                        self._fail_all(None)
                        return
                    block = False
            except queue.Empty:
                pass
            if not self.engine.has_work():
                self._stats = self.engine.stats()  # after aborts, so an idle engine reports itself idle
                continue
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
                request_id, error if error is not None else GenerationChunk(text="", token_ids=[], finish_reason="abort")
            )
