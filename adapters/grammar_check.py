"""A structured output's grammar is tried first where the trial can be stopped.

vLLM compiles each request's grammar (its JSON schema, regex, EBNF grammar, choices or structural
tag) in the engine core, on (cores + 1) // 2 threads that nobody can stop and every structured
request of the engine shares; then, for every token, it works out the grammar's mask of allowed
tokens on the core's step thread, which every request of the engine waits on. Neither cost is
bounded by the grammar's size:
- compiling: xgrammar's automaton for the 15-character regex `[ab]*a[ab]{n}` doubles with each n
  (0.6 s at 12 on our tiny model's vocabulary, 11 s at 14; at 20 a core thread was still compiling
  after 44 minutes); `((c{1000}){1000}){1000}` takes 3.4 s and ~600 MB;
- generating: an ambiguous grammar (`e ::= e e | "a" | "b"`) compiles in milliseconds, but its
  matcher's work grows with every token (~30 ms a token after 200): 16 such sequences stopped every
  request of the engine for 5 minutes.
A bound on characters cannot tell such grammars from harmless ones; running them can.

So the worker tries every grammar it has not seen before the engine gets it, in a child process
with the engine's own backend and configuration (vLLM's backend classes, as its core builds them):
it compiles it, then generates `TRIAL_TOKENS` tokens under it (each a random allowed one, as a
random-weight model would pick), timing each token's mask and step. Past the deadline
(`grammar_compile_s`), or `MEMORY_BYTES` more memory, the child is killed (and started again for
the next grammar); past `STEP_S` a token, the trial stops. Either way the request is refused
(`RESOURCE_EXHAUSTED`). A grammar the backend cannot compile, or that kills the child, is refused as
well (`INVALID_ARGUMENT`): in the core the same failure kills the engine. Outcomes are kept by the
grammar's hash, so a grammar is tried once (a refusal is tried again after `REFUSAL_TTL_S`, in case
the machine was only busy). The child tries one grammar at a time and takes hosts in turn, and a
host's clients in turn, so one host's stream of slow grammars delays another's new grammar by one
trial at most (a spare child is kept started once one has been killed, so no trial waits for one).

The child (`python -m adapters.grammar_check`) is started at the first grammar a worker checks,
holds one backend per engine configuration, and dies with the worker.

A trial cannot show every path: a grammar cheap on a random path can be costly where a client
steers it (`logit_bias`), and the engine core then ends its sequences (`engine_core.py`), but only
after the step that showed the cost, which every request of the engine waited on (~1 s for 16
sequences). The worker learns of each such end (`grammar_ends.py`), and makes a repeat cost nothing:
the client (its host, as for turns) gets no structured output for `COOLDOWN_S`, twice as long after
each more end within `STRIKES_KEPT_S` (at most `COOLDOWN_MAX_S`), whatever grammar it sends, known
ones too (a client that had many grammars accepted first could otherwise spend them one by one); its
structured requests already in the engine end then too, and ends of requests admitted before the
cooldown began do not count again. The grammar stays refused to that client, and to every client
once it was ended for two hosts: one end may have been a noisy step, and the grammar some other
client's ordinary one. Requests without a structured output are served as before. A client with an
identity (a token or a certificate) answers for itself alone; without one, its host answers, every
client of that host with it.
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
from bridge_server.wire.protocol import host_of

log = logging.getLogger("vllm_bridge.grammar")

# What one trial may add to the child's memory (a JSON schema at the bound on characters takes tens of
# MB on a large vocabulary; the nested repeats above ~600 MB, and as much again in the engine core).
MEMORY_BYTES = 256 << 20
# The child is started afresh once it holds this much more than when it started (what compiles leave).
KEEP_BYTES = 1 << 30
# Tokens generated under a grammar in its trial, and what one token's mask and step may cost there,
# as the mean of WINDOW tokens in a row (a JSON schema's: ~5 us on our tiny model's vocabulary; tens
# of us on a large one).
TRIAL_TOKENS = 512
STEP_S = 0.002
WINDOW = 8
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
# After the engine core ended a client's sequence for its grammar's cost: how long the client gets no
# structured output, doubled after each more end within STRIKES_KEPT_S, up to COOLDOWN_MAX_S; and how
# many clients' ends are remembered.
COOLDOWN_S = 10.0
COOLDOWN_MAX_S = 600.0
STRIKES_KEPT_S = 3600.0
STRIKERS = 4096


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


async def _spawn() -> _Child:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_XGRAMMAR_CACHE_MB": "64"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "adapters.grammar_check", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        limit=1 << 20)
    child = _Child(proc, 0)
    try:
        ready = await asyncio.wait_for(_read(proc.stdout), START_S)
    except (TimeoutError, asyncio.CancelledError):
        await _kill(child)
        raise
    if not isinstance(ready, dict) or not ready.get("ready"):
        await _kill(child)
        raise RuntimeError(f"the grammar checker did not start: {ready!r}")
    child.baseline = _resident(proc.pid)
    return child


async def _kill(child: _Child) -> None:
    with contextlib.suppress(ProcessLookupError):
        child.proc.kill()
    await child.proc.wait()


class GrammarChecks:
    """One worker's trial compiles: the child, the outcomes, and the clients' turns."""

    def __init__(self, memory_bytes: int = MEMORY_BYTES) -> None:
        self.memory_bytes = memory_bytes
        self._known: collections.OrderedDict[bytes, tuple[Refusal | None, float]] = collections.OrderedDict()
        self._running: dict[bytes, _Job] = {}
        self._turns: dict[str, collections.deque[_Job]] = {}
        self._runner: asyncio.Task[None] | None = None
        self._child: _Child | None = None
        self._spare: asyncio.Task[_Child] | None = None
        # Per host (`host_of`), when the engine core ended its sequences for their grammars' cost
        # (strikes: not the ends during a cooldown, of requests admitted before it); the least
        # recently struck host first. Per grammar, the hosts it was ended for, when, and why.
        self._strikes: collections.OrderedDict[str, list[float]] = collections.OrderedDict()
        self._ends: collections.OrderedDict[bytes, dict[str, tuple[float, str]]] = collections.OrderedDict()
        self.compiled = 0                  # compiles run (for the tests and the logs)

    async def check(self, config: str, blob: bytes, backend: str, kind: str, spec: str, client: str,
                    deadline_s: float, key: bytes | None = None) -> Refusal | None:
        """None when the grammar compiles within the bounds (now or before), else why not. With
        `deadline_s` 0 nothing new is tried, but what the engine ended is refused all the same.
        `key`: the grammar's `grammar_key`, where the caller has it already."""
        refusal = self.cooling(client)
        if refusal is not None:
            return refusal
        key = key or grammar_key(config, backend, kind, spec)
        refusal = self._ended_for(key, client)
        if refusal is not None:
            return refusal
        refusal = await self._tried(key, config, blob, backend, kind, spec, client, deadline_s)
        # A trial may have waited its turn while another request of the client's was ended
        return refusal if refusal is not None else self.cooling(client)

    async def _tried(self, key: bytes, config: str, blob: bytes, backend: str, kind: str, spec: str, client: str,
                     deadline_s: float) -> Refusal | None:
        known = self._known.get(key)
        if known is not None:
            refusal, at = known
            if refusal is None or time.monotonic() - at < REFUSAL_TTL_S:
                self._known.move_to_end(key)
                return refusal
        if deadline_s <= 0:
            return None
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
        served: collections.Counter[str] = collections.Counter()   # trials since the queue was last empty
        while self._turns:
            # The waiting client whose host was served least goes next, of its host's the client
            # served least (the earliest of those): a newcomer comes right after the trial under way,
            # whatever another client has queued, and a host's many connections count as one.
            client = min(self._turns, key=lambda c: (served[host_of(c)], served[c]))
            queue = self._turns[client]
            job = queue.popleft()
            if not queue:
                del self._turns[client]
            served.update((host_of(client), client))
            try:
                outcome = await self._compile(job)
            except Exception as exc:         # the checker itself failed: refuse, say why, keep serving
                log.exception("grammar check failed")
                outcome = Refusal(grpc.StatusCode.UNAVAILABLE, "grammar check failed",
                                  f"the server could not check it ({type(exc).__name__}: {str(exc)[:200]})")
                await self._stop()
            self._running.pop(job.key, None)
            if outcome is None or outcome.code != grpc.StatusCode.UNAVAILABLE:
                self._remember(job.key, outcome)
            if not job.done.done():
                job.done.set_result(outcome)

    def _remember(self, key: bytes, outcome: Refusal | None) -> None:
        self._known[key] = (outcome, time.monotonic())
        self._known.move_to_end(key)
        while len(self._known) > KNOWN:
            self._known.popitem(last=False)

    def ended(self, key: bytes, client: str, why: str) -> bool:
        """The engine core ended a sequence of `client`'s under the grammar `key` for its cost (`why`,
        the core's stop reason): the client cools down, unless it is cooling already (the request was
        admitted before), and the grammar is refused to it, and to everyone once ended for two hosts.
        Whether a cooldown began."""
        host, now = host_of(client), time.monotonic()
        ends = self._ends.pop(key, {})
        ends[host] = (now, why)
        self._ends[key] = ends
        while len(self._ends) > KNOWN:
            self._ends.popitem(last=False)
        if self.cooling(client) is not None:
            return False
        strikes = self._strikes.pop(host, [])
        strikes.append(now)
        self._strikes[host] = strikes
        while len(self._strikes) > STRIKERS:
            self._strikes.popitem(last=False)
        log.warning("the engine ended a sequence of %s for its grammar's cost (%d time(s) within %g s): %s", host,
                    len(strikes), STRIKES_KEPT_S, why)
        return True

    def _ended_for(self, key: bytes, client: str) -> Refusal | None:
        """Why the grammar `key` is refused to `client` for what the engine ended under it, if it is.
        One host's end does not refuse it to others: a short grammar that was ended once for a
        noisy step is some other client's ordinary one."""
        ends = self._ends.get(key)
        if not ends:
            return None
        now = time.monotonic()
        for gone in [h for h, (at, _) in ends.items() if now - at > REFUSAL_TTL_S]:
            del ends[gone]
        if not ends:
            del self._ends[key]
            return None
        host = host_of(client)
        if host not in ends and len(ends) < 2:
            return None
        why = ends[host][1] if host in ends else max(ends.values())[1]
        whose = "this client's" if host in ends else f"{len(ends)} clients'"
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "grammar too costly",
                       f"the engine ended {whose} sequences under it for what they cost: {why}")

    def cooling(self, client: str) -> Refusal | None:
        """Why `client`'s structured outputs are refused for now, if they are (module docstring)."""
        host = host_of(client)
        strikes = self._strikes.get(host)
        if not strikes:
            return None
        now = time.monotonic()
        while strikes and now - strikes[0] > STRIKES_KEPT_S:
            del strikes[0]
        if not strikes:
            del self._strikes[host]
            return None
        pause = min(COOLDOWN_MAX_S, COOLDOWN_S * 2.0 ** min(len(strikes) - 1, 64))
        left = strikes[-1] + pause - now
        if left <= 0:
            return None
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "grammars ended for cost",
                       f"the engine ended this client's sequences for their grammars' cost {len(strikes)} time(s) "
                       f"within {STRIKES_KEPT_S / 60:g} minutes (the latest {now - strikes[-1]:.0f} s ago), holding up "
                       f"every request of the engine; its structured outputs are refused for {left:.0f} s more, "
                       f"twice as long after each more (requests without one are served)")

    async def _compile(self, job: _Job) -> Refusal | None:
        child = await self._current()
        if job.config not in child.configs:
            await _send(child, {"op": "config", "id": job.config, "blob": base64.b64encode(job.blob).decode("ascii")})
            child.configs.add(job.config)
        await _send(child, {"op": "backend", "config": job.config, "backend": job.backend})
        reply = await self._reply(child, START_S, None)
        if reply is None or not reply.get("ok"):
            raise RuntimeError(f"the {job.backend} backend could not be built: {reply and reply.get('error')}")
        await _send(child, {"op": "compile", "config": job.config, "backend": job.backend, "kind": job.kind,
                            "spec": job.spec, "tokens": TRIAL_TOKENS, "step_s": STEP_S, "window": WINDOW})
        self.compiled += 1
        started = time.monotonic()
        reply = await self._reply(child, job.deadline_s, self.memory_bytes)
        took = time.monotonic() - started
        if isinstance(reply, dict) and _resident(child.proc.pid) - child.baseline > KEEP_BYTES:
            await self._stop()
        if isinstance(reply, Refusal):
            log.warning("grammar check: %s; the checker was restarted", reply.why)
            return reply
        if reply is None:       # the child died compiling it: so would the engine core
            await self._stop()
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "grammar does not compile",
                           f"compiling it with vLLM's {job.backend} backend killed the process compiling it")
        if reply.get("slow"):
            return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "grammar too costly",
                           f"generating under it, the grammar alone cost {reply['step_s'] * 1000:.1f} ms a token "
                           f"after {reply['steps']} tokens, over this server's limit of {STEP_S * 1000:g} ms (the "
                           f"engine works out every token's mask on the thread every request of the engine waits on)")
        if not reply.get("ok"):
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, "grammar does not compile",
                           f"vLLM's {job.backend} backend cannot compile it: {str(reply.get('error'))[:300]}")
        log.debug("grammar check: %s %s tried in %.3f s (%s tokens)", job.backend, job.kind, took, reply.get("steps"))
        return None

    async def _reply(self, child: _Child, limit_s: float, memory: int | None) -> Any:
        """The child's next message; a Refusal once it has run `limit_s` or taken `memory` more bytes
        (it is killed then); None if it died."""
        reading = asyncio.ensure_future(_read(child.proc.stdout))
        started, before = time.monotonic(), _resident(child.proc.pid) if memory is not None else 0
        try:
            while True:
                done, _ = await asyncio.wait({reading}, timeout=POLL_S)
                if done:
                    return reading.result()
                took = time.monotonic() - started
                grown = _resident(child.proc.pid) - before if memory is not None else 0
                if took >= limit_s or memory is not None and grown > memory:
                    await self._stop()
                    if memory is None:
                        raise RuntimeError(f"the grammar checker did not answer within {limit_s:g} s")
                    what = (f"it took more than {grown >> 20:,} MiB, over this server's limit of {memory >> 20:,} "
                            f"MiB" if took < limit_s else
                            f"it did not compile and generate {TRIAL_TOKENS} tokens within {limit_s:g} s, this "
                            f"server's limit (pool key grammar_compile_s)")
                    return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "grammar too costly",
                                   f"{what}; the engine compiles a grammar where nothing can stop it, holding up "
                                   f"every structured request behind it")
        finally:
            reading.cancel()

    async def _current(self) -> _Child:
        """The child that tries grammars: the one there is, else the spare (a new spare is started
        behind it), else a new one."""
        if self._child is None:
            spare, self._spare = self._spare, None
            self._child = await (spare if spare is not None else _spawn())
            if spare is not None:
                self._spare = asyncio.get_running_loop().create_task(_spawn())
        return self._child

    async def _stop(self) -> None:
        """Kills the child. A child is killed for a grammar past its bounds, and a stranger can send
        one after another: from the first, a spare is kept started (~5 s to start, ~450 MB), so the
        next grammar waits for no start."""
        child, self._child = self._child, None
        if child is None:
            return
        await _kill(child)
        if self._spare is None:
            self._spare = asyncio.get_running_loop().create_task(_spawn())

    async def close(self) -> None:
        child, self._child = self._child, None
        spare, self._spare = self._spare, None
        if child is not None:
            await _kill(child)
        if spare is not None:
            with contextlib.suppress(Exception):
                await _kill(await spare)

    @property
    def child_pid(self) -> int | None:
        return self._child.proc.pid if self._child is not None else None

    async def spare_pid(self) -> int | None:
        """The spare child's, once started (None: no spare)."""
        return (await asyncio.shield(self._spare)).proc.pid if self._spare is not None else None


_checks: GrammarChecks | None = None
_engine_configs: weakref.WeakKeyDictionary[Any, tuple[str, bytes]] = weakref.WeakKeyDictionary()


def checks() -> GrammarChecks:
    """The worker's one set of trial compiles (one child for every engine of the worker)."""
    global _checks
    if _checks is None:
        _checks = GrammarChecks()
    return _checks


def grammar_key(config: str, backend: str, kind: str, spec: str) -> bytes:
    """What a grammar's outcome is remembered by: the engine's configuration, the backend and the
    grammar as vLLM keys it."""
    return hashlib.sha256(json.dumps([config, backend, kind, spec]).encode("utf-8", "surrogatepass")).digest()


def _engine_config(engine: Any) -> tuple[str, bytes]:
    known = _engine_configs.get(engine)
    if known is None:
        blob = pickle.dumps(engine.vllm_config)
        known = (hashlib.sha256(blob).hexdigest()[:16], blob)
        with contextlib.suppress(TypeError):
            _engine_configs[engine] = known
    return known


async def check(engine: Any, label: str, request: Any, client: str, deadline_s: float) -> bytes | None:
    """Refuses a request whose structured output does not compile within the bounds, or whose grammar
    or client the engine has ended sequences of (module docstring). Returns the grammar's key, for
    `grammar_ends.watch`; None for a request without a grammar. With `deadline_s` 0 nothing new is
    tried."""
    params = getattr(request, "sampling_params", None)
    so = getattr(params, "structured_outputs", None)
    if so is None or getattr(engine.model_config, "skip_tokenizer_init", False):
        return None
    from vllm.v1.structured_output.request import get_structured_output_key
    try:
        kind, spec = get_structured_output_key(so)
    except ValueError:
        return None       # nothing to compile: vLLM says so itself
    backend = str(so._backend or engine.vllm_config.structured_outputs_config.backend)
    config, blob = _engine_config(engine)
    key = grammar_key(config, backend, kind.name, spec)
    refusal = await checks().check(config, blob, backend, kind.name, spec, client, deadline_s, key)
    if refusal is not None:
        where = "sampling_params.structured_outputs"
        raise BridgeError(refusal.code, "validation", f"{label}: parameter {where}: {refusal.why}", target=label,
                          parameter=where, reason=refusal.reason)
    return key


def _resident(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _frame(message: dict[str, Any]) -> bytes:
    """A message between the worker and its child: JSON, prefixed by its length."""
    data = json.dumps(message).encode("utf-8", "surrogatepass")
    return _HEADER.pack(len(data)) + data


async def _send(child: _Child, message: dict[str, Any]) -> None:
    assert child.proc.stdin is not None
    child.proc.stdin.write(_frame(message))
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


def _trial(backend: Any, grammar: Any, vocab_size: int, stop_ids: set[int], tokens: int, step_s: float,
           window: int) -> dict[str, Any]:
    """Generates up to `tokens` tokens under a compiled grammar, each a random allowed one other than
    a stop token while there are others (as with `min_tokens`), timing what the engine core does per
    token: the mask, then the step (the thread's CPU time, as the core's bound counts it: a wait for a
    busy machine's core is not the grammar's). Stops once `window` tokens in a row cost `step_s` each
    on average."""
    import random

    import numpy as np
    mask = backend.allocate_token_bitmask(1)
    pick = random.Random(0)
    costs: list[float] = []
    for _ in range(tokens):
        if grammar.is_terminated():
            break
        started = time.thread_time()
        grammar.fill_bitmask(mask, 0)
        cost = time.thread_time() - started
        allowed = np.flatnonzero(np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab_size])
        if not len(allowed):
            break
        choice = int(allowed[pick.randrange(len(allowed))])
        for _ in range(8):      # a stop token ends generation: another, where there is one
            if choice not in stop_ids:
                break
            choice = int(allowed[pick.randrange(len(allowed))])
        started = time.thread_time()
        if not grammar.accept_tokens("trial", [choice]):
            break
        costs.append(cost + time.thread_time() - started)
        if len(costs) >= window and sum(costs[-window:]) / window > step_s:
            return {"ok": False, "slow": True, "steps": len(costs), "step_s": sum(costs[-window:]) / window}
    return {"ok": True, "steps": len(costs)}


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
    backend = cls(config, tokenizer=tokenizer, vocab_size=vocab_size)
    eos = getattr(tokenizer, "eos_token_id", None)
    return backend, vocab_size, {eos} if isinstance(eos, int) else set()


def _write(out: BinaryIO, message: dict[str, Any]) -> None:
    out.write(_frame(message))
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
                _write(out, {"ok": True})
            else:
                backend, vocab_size, stop_ids = backends[name]
                grammar = backend.compile_grammar(StructuredOutputOptions[message["kind"]], message["spec"])
                _write(out, _trial(backend, grammar, vocab_size, stop_ids, message["tokens"], message["step_s"],
                                   message["window"]))
        except Exception as exc:  # noqa: BLE001 - the grammar's fault, reported back; the child goes on
            _write(out, {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})


if __name__ == "__main__":
    main()
