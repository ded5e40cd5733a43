"""A structured output's grammar is compiled first where the compile can be stopped.

vLLM compiles each request's grammar (its JSON schema, regex, EBNF grammar, choices or structural
tag) in the engine core, on a thread nobody can stop, on (cores + 1) // 2 threads shared by every
structured request of the engine. The work a grammar needs is not bounded by its size: xgrammar's
automaton for the 15-character regex `[ab]*a[ab]{n}` doubles with each n (0.6 s at 12 on our tiny
model's vocabulary, 11 s at 14; at 20 a core thread was still compiling after 44 minutes). A bound
on characters cannot tell such a pattern from a harmless one; running it can.

So the worker compiles every grammar it has not seen before the engine gets it: in a child process,
with the engine's own backend and configuration (vLLM's backend classes, as its core builds them),
under a deadline (`grammar_compile_s`) and a bound on the memory the compile may take. A child past
either is killed (and started again for the next grammar), and the request is refused
(`RESOURCE_EXHAUSTED`); a grammar the backend cannot compile, or that kills the child, is refused
as well (`INVALID_ARGUMENT`): in the core the same failure kills the engine. Outcomes are kept by
the grammar's hash, so a grammar is tried once (a refusal is tried again after `REFUSAL_TTL_S`, in
case the machine was only busy). The child compiles one grammar at a time and takes clients in
turn, so one client's stream of slow grammars delays another's new grammar by one compile at most.

The child (`python -m adapters.grammar_check`) is started at the first grammar a worker checks,
holds one backend per engine configuration, and dies with the worker.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import importlib
import json
import logging
import os
import pickle
import struct
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import grpc

from bridge_server.wire.errors import BridgeError

log = logging.getLogger("vllm_bridge.grammar")

# What a compile may add to the child's memory (its resident size over what it held when started).
MEMORY_BYTES = 2 << 30
# A grammar refused for its time or memory is tried again after this long (the machine may have
# been busy); what the backend cannot compile stays refused as long.
REFUSAL_TTL_S = 600.0
# Grammars whose outcome is remembered (by hash: 32 bytes each).
KNOWN = 4096
# How long the child may take to start (importing vLLM's backends) or to build a backend (loading a
# tokenizer): not the grammar's cost, so not under its deadline.
START_S = 180.0
POLL_S = 0.05
_HEADER = struct.Struct(">I")


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    reason: str
    why: str


@dataclass
class _Job:
    key: bytes
    config: str
    blob: bytes                        # the engine's configuration, pickled (the worker's own)
    backend: str
    kind: str
    spec: str
    deadline_s: float
    done: asyncio.Future[Refusal | None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class _Child:
    proc: asyncio.subprocess.Process
    baseline: int                      # resident bytes once started
    configs: set[str] = field(default_factory=set)


class GrammarChecks:
    """One worker's trial compiles: the child, the outcomes, and the clients' turns."""

    def __init__(self, memory_bytes: int = MEMORY_BYTES) -> None:
        self.memory_bytes = memory_bytes
        self._known: collections.OrderedDict[bytes, tuple[Refusal | None, float]] = collections.OrderedDict()
        self._running: dict[bytes, _Job] = {}
        self._turns: dict[str, collections.deque[_Job]] = {}
        self._runner: asyncio.Task[None] | None = None
        self._child: _Child | None = None
        self.compiled = 0                  # compiles run (for the tests and the logs)

    async def check(self, config: str, blob: bytes, backend: str, kind: str, spec: str, client: str,
                    deadline_s: float) -> Refusal | None:
        """None when the grammar compiles within the bounds (now or before), else why not."""
        key = hashlib.sha256(json.dumps([config, backend, kind, spec]).encode("utf-8", "surrogatepass")).digest()
        known = self._known.get(key)
        if known is not None:
            refusal, at = known
            if refusal is None or time.monotonic() - at < REFUSAL_TTL_S:
                self._known.move_to_end(key)
                return refusal
        job = self._running.get(key)
        if job is None:
            job = self._running[key] = _Job(key, config, blob, backend, kind, spec, deadline_s)
            self._turns.setdefault(client, collections.deque()).append(job)
            if self._runner is None or self._runner.done():
                self._runner = asyncio.get_running_loop().create_task(self._run())
        return await asyncio.shield(job.done)

    async def _run(self) -> None:
        try:
            await self._serve_turns()
        finally:        # cancelled (the loop is closing): nobody waits for an answer that never comes
            for job in self._running.values():
                if not job.done.done():
                    job.done.cancel()
            self._running.clear()
            self._turns.clear()

    async def _serve_turns(self) -> None:
        served: dict[str, int] = {}      # compiles each client had since the queue was last empty
        while self._turns:
            # The waiting client served least goes next (the earliest of those): a newcomer comes
            # right after the compile under way, whatever another client has queued.
            client = min(self._turns, key=lambda c: served.get(c, 0))
            queue = self._turns[client]
            job = queue.popleft()
            if not queue:
                del self._turns[client]
            served[client] = served.get(client, 0) + 1
            try:
                outcome = await self._compile(job)
            except Exception as exc:         # the checker itself failed: refuse, say why, keep serving
                log.exception("grammar check failed")
                outcome = Refusal(grpc.StatusCode.UNAVAILABLE, "grammar check failed",
                                  f"the server could not check it ({type(exc).__name__}: {str(exc)[:200]})")
                await self._stop()
            self._running.pop(job.key, None)
            if outcome is None or outcome.code != grpc.StatusCode.UNAVAILABLE:
                self._known[job.key] = (outcome, time.monotonic())
                while len(self._known) > KNOWN:
                    self._known.popitem(last=False)
            if not job.done.done():
                job.done.set_result(outcome)

    async def _compile(self, job: _Job) -> Refusal | None:
        child = self._child or await self._start()
        if job.config not in child.configs:
            await _send(child, {"op": "config", "id": job.config, "blob": base64.b64encode(job.blob).decode("ascii")})
            child.configs.add(job.config)
        await _send(child, {"op": "backend", "config": job.config, "backend": job.backend})
        reply = await self._reply(child, START_S, None)
        if reply is None or not reply.get("ok"):
            raise RuntimeError(f"the {job.backend} backend could not be built: {reply and reply.get('error')}")
        await _send(child, {"op": "compile", "config": job.config, "backend": job.backend, "kind": job.kind,
                            "spec": job.spec})
        self.compiled += 1
        started = time.monotonic()
        reply = await self._reply(child, job.deadline_s, self.memory_bytes)
        took = time.monotonic() - started
        if isinstance(reply, Refusal):
            log.warning("grammar check: %s; the checker was restarted", reply.why)
            return reply
        if reply is None:       # the child died compiling it: so would the engine core
            await self._stop()
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "grammar does not compile",
                           f"compiling it with vLLM's {job.backend} backend killed the process compiling it")
        if not reply.get("ok"):
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "grammar does not compile",
                           f"vLLM's {job.backend} backend cannot compile it: {str(reply.get('error'))[:300]}")
        log.debug("grammar check: %s %s compiled in %.3f s", job.backend, job.kind, took)
        return None

    async def _reply(self, child: _Child, limit_s: float, memory: int | None) -> Any:
        """The child's next message; a Refusal once it has run `limit_s` or taken `memory` more bytes
        (it is killed then); None if it died."""
        reading = asyncio.ensure_future(_read(child.proc.stdout))
        started = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({reading}, timeout=POLL_S)
                if done:
                    return reading.result()
                took = time.monotonic() - started
                grown = _resident(child.proc.pid) - child.baseline if memory is not None else 0
                if took >= limit_s or memory is not None and grown > memory:
                    await self._stop()
                    if memory is None:
                        raise RuntimeError(f"the grammar checker did not answer within {limit_s:g} s")
                    what = (f"it took more than {grown >> 20:,} MiB, over this server's limit of {memory >> 20:,} "
                            f"MiB" if took < limit_s else
                            f"it did not compile within {limit_s:g} s, this server's limit (pool key grammar_compile_s)")
                    return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "grammar too costly",
                                   f"{what}; the engine compiles a grammar where nothing can stop it, holding up "
                                   f"every structured request behind it")
        finally:
            reading.cancel()

    async def _start(self) -> _Child:
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_XGRAMMAR_CACHE_MB": "64"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "adapters.grammar_check", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            limit=1 << 20)
        child = _Child(proc, 0)
        self._child = child
        ready = await self._reply(child, START_S, None)
        if not isinstance(ready, dict) or not ready.get("ready"):
            await self._stop()
            raise RuntimeError(f"the grammar checker did not start: {ready!r}")
        child.baseline = _resident(proc.pid)
        return child

    async def _stop(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        with contextlib.suppress(ProcessLookupError):
            child.proc.kill()
        await child.proc.wait()

    async def close(self) -> None:
        await self._stop()

    @property
    def child_pid(self) -> int | None:
        return self._child.proc.pid if self._child is not None else None


_checks: GrammarChecks | None = None
_engine_configs: weakref.WeakKeyDictionary[Any, tuple[str, bytes]] = weakref.WeakKeyDictionary()


def checks() -> GrammarChecks:
    """The worker's one set of trial compiles (one child for every engine of the worker)."""
    global _checks
    if _checks is None:
        _checks = GrammarChecks()
    return _checks


def _engine_config(engine: Any) -> tuple[str, bytes]:
    known = _engine_configs.get(engine)
    if known is None:
        blob = pickle.dumps(engine.vllm_config)
        known = (hashlib.sha256(blob).hexdigest()[:16], blob)
        with contextlib.suppress(TypeError):
            _engine_configs[engine] = known
    return known


async def check(engine: Any, label: str, request: Any, client: str, deadline_s: float) -> None:
    """Refuses a request whose structured output does not compile within the bounds (module
    docstring); a request without one, or any with `deadline_s` 0, passes."""
    params = getattr(request, "sampling_params", None)
    so = getattr(params, "structured_outputs", None)
    if so is None or deadline_s <= 0 or getattr(engine.model_config, "skip_tokenizer_init", False):
        return
    from vllm.v1.structured_output.request import get_structured_output_key
    try:
        kind, spec = get_structured_output_key(so)
    except ValueError:
        return       # nothing to compile: vLLM says so itself
    backend = so._backend or engine.vllm_config.structured_outputs_config.backend
    config, blob = _engine_config(engine)
    refusal = await checks().check(config, blob, str(backend), kind.name, spec, client, deadline_s)
    if refusal is not None:
        where = "sampling_params.structured_outputs"
        raise BridgeError(refusal.code, "validation", f"{label}: parameter {where}: {refusal.why}", target=label,
                          parameter=where, reason=refusal.reason)


def _resident(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


async def _send(child: _Child, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode("utf-8", "surrogatepass")
    assert child.proc.stdin is not None
    child.proc.stdin.write(_HEADER.pack(len(data)) + data)
    await child.proc.stdin.drain()


async def _read(stream: asyncio.StreamReader | None) -> Any:
    assert stream is not None
    try:
        size, = _HEADER.unpack(await stream.readexactly(_HEADER.size))
        return json.loads(await stream.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


# ------------------------------------------------------------------------------------ the child
def _die_with_parent() -> None:
    """The child may be deep in a compile when its worker goes: the kernel ends it then (Linux)."""
    import ctypes
    import signal
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(0)


def _backend(config: Any, name: str) -> Any:
    """The backend vLLM's engine core builds for this configuration (its StructuredOutputManager)."""
    from vllm.tokenizers import cached_tokenizer_from_config
    tokenizer = cached_tokenizer_from_config(model_config=config.model_config)
    vocab_size = config.model_config.get_vocab_size()
    modules = {"xgrammar": ("backend_xgrammar", "XgrammarBackend"), "guidance": ("backend_guidance", "GuidanceBackend"),
               "outlines": ("backend_outlines", "OutlinesBackend"),
               "lm-format-enforcer": ("backend_lm_format_enforcer", "LMFormatEnforcerBackend")}
    if name not in modules:
        raise ValueError(f"unknown structured output backend {name!r}")
    module, cls_name = modules[name]
    cls = getattr(importlib.import_module(f"vllm.v1.structured_output.{module}"), cls_name)
    return cls(config, tokenizer=tokenizer, vocab_size=vocab_size)


def _write(out: BinaryIO, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode("utf-8", "surrogatepass")
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def main() -> None:
    _die_with_parent()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                  # whatever vLLM prints goes to the worker's log, not into the replies
    inp = sys.stdin.buffer
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    configs: dict[str, Any] = {}
    backends: dict[tuple[str, str], Any] = {}
    _write(out, {"ready": True})
    while True:
        head = inp.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return
        message = json.loads(inp.read(_HEADER.unpack(head)[0]))
        op = message["op"]
        if op == "config":
            configs[message["id"]] = pickle.loads(base64.b64decode(message["blob"]))   # the worker's own
            continue
        name = (message["config"], message["backend"])
        try:
            if op == "backend":
                if name not in backends:
                    backends[name] = _backend(configs[name[0]], name[1])
            else:
                backends[name].compile_grammar(StructuredOutputOptions[message["kind"]], message["spec"])
            _write(out, {"ok": True})
        except Exception as exc:  # noqa: BLE001 - the grammar's fault, reported back; the child goes on
            _write(out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})


if __name__ == "__main__":
    main()
