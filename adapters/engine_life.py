"""How an engine lives and dies under the worker: whether it can still serve (its core process
exited, or it stopped answering while using no CPU), failing its calls at once with the cause once it
cannot, warming it up before anyone's first request pays for what vLLM compiles on first use, and
shutting it down when its last ref goes. The engine adapter (`async_llm.py`) declares these as its
`Lifecycle` and guards; the worker's liveness probe calls them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import time
import weakref
from collections.abc import Mapping
from typing import Any

import grpc
import psutil

from adapters.spec import CallContext
from bridge_server.wire.errors import BridgeError

__all__ = ["BUSY_CPU_SHARE", "PREFIX", "alive", "answers", "core_cpu_s", "dead", "kill", "serving", "shutdown",
           "sleep", "started", "wake_up", "warmup"]

log = logging.getLogger("vllm_bridge.engine")
PREFIX = "vllm.AsyncLLMEngine"
_causes: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()   # engine -> why it is dead
_warmups = itertools.count(1)


def alive(engine: Any, args: Mapping[str, Any], ctx: CallContext | None = None) -> None:
    """Every call on a dead engine fails at once with the cause, instead of vLLM's own error later
    (or, for an engine that stopped answering, never)."""
    if engine is None:
        return
    cause = _causes.get(engine)
    if cause is None and getattr(engine, "errored", False):
        cause = f"the engine core exited ({getattr(engine, 'dead_error', 'no error recorded')})"
    if cause is not None:
        raise BridgeError(grpc.StatusCode.UNAVAILABLE, "engine", f"{PREFIX}: engine dead: {cause}",
                          target=PREFIX, reason="engine dead")


def busy(engine: Any) -> bool:
    """Whether the engine holds live requests (a stream a client is reading, a collector not yet read)."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    return bool(states)


def dead(engine: Any) -> str | None:
    """Why the engine can no longer serve, when vLLM knows (its core process exited) or we decided."""
    if (cause := _causes.get(engine)) is not None:
        return cause
    if getattr(engine, "errored", False):
        return f"the engine core exited ({getattr(engine, 'dead_error', 'no error recorded')})"
    return None


# A core that used at least this share of a core's time while its probe went unanswered is working
# (starved by a busy machine, or on a long step), not wedged: a wedged core waits on a queue or a
# dead peer and uses next to none.
BUSY_CPU_SHARE = 0.05


async def answers(engine: Any, timeout_s: float) -> bool:
    """A utility call travels the same path as a request (in through the core's input thread, back
    through the output handler): an answer shows both are alive. So does a core process that kept
    computing meanwhile: on a loaded machine the answer may come late, and killing an engine that
    is only slow would harm every client it serves."""
    before = core_cpu_s(engine)
    try:
        await asyncio.wait_for(engine.is_sleeping(), timeout_s)
    except asyncio.TimeoutError:
        after = core_cpu_s(engine)
        if before is not None and after is not None and after - before >= BUSY_CPU_SHARE * timeout_s:
            log.warning("%s: the engine core answered no probe within %g s but used %.2f s of CPU meanwhile: "
                        "busy, not dead", PREFIX, timeout_s, after - before)
            return True
        return False
    except Exception:   # EngineDeadError and the like: `dead` says so next
        return False
    return True


def stopped(engine: Any) -> str | None:
    """A core process stopped by a signal (SIGSTOP, a debugger) answers nothing until it is continued."""
    for proc in _core_processes(engine):
        try:
            if psutil.Process(proc.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                return f"its engine core (pid {proc.pid}) is stopped by a signal and answers nothing"
        except (psutil.Error, OSError, AttributeError, TypeError, ValueError):
            continue
    return None


def _core_processes(engine: Any) -> list[Any]:
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or ())


def core_cpu_s(engine: Any) -> float | None:
    """The CPU time the engine's core processes have used so far (None when it cannot be read)."""
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    total = 0.0
    try:
        for proc in _core_processes(engine):
            times = psutil.Process(proc.pid).cpu_times()
            total += times.user + times.system
    except (psutil.Error, OSError, AttributeError, TypeError, ValueError):   # OSError: none left to open /proc with
        return None
    return total if manager is not None else None


_asleep: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


async def serving(engine: Any, method: str) -> None:
    """A request to an engine its operator paused would wait, silently, until it resumes (or the
    caller's deadline); one to an engine put to sleep would find its memory gone. Either fails at
    once, UNAVAILABLE (a state that passes), saying why."""
    why = "asleep (wake_up wakes it)" if _asleep.get(engine) else \
        "paused (resume_generation resumes it)" if await engine.is_paused() else None
    if why is not None:
        raise BridgeError(grpc.StatusCode.UNAVAILABLE, "engine", f"{PREFIX}.{method}: the engine is {why}",
                          target=f"{PREFIX}.{method}", reason="engine idle")


async def sleep(engine: Any, level: int = 1) -> None:
    """vLLM's sleep levels are 1 (weights offloaded) and 2 (discarded); any other failed only in its
    core, after the engine was already counted asleep here, so every later request was refused."""
    if type(level) is not int or level not in (1, 2):
        shown = level if type(level) is int and abs(level) < 10**6 else type(level).__name__
        raise BridgeError.validation(f"{PREFIX}.sleep: parameter level: expected 1 or 2, got {shown}",
                                     target=f"{PREFIX}.sleep", parameter="level")
    _asleep[engine] = True
    try:
        await engine.sleep(level)
    except BaseException:
        _asleep[engine] = False
        raise


async def wake_up(engine: Any, tags: list[str] | None = None) -> None:
    await engine.wake_up(tags)
    _asleep[engine] = False


def kill(engine: Any, cause: str) -> None:
    """From now on the engine counts as dead: every call fails at once with `cause`, the requests in
    flight end with it too, and its core process is stopped (off the event loop)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    _causes[engine] = cause
    core = getattr(engine, "engine_core", None)
    resources = getattr(core, "resources", None)
    if resources is not None:
        resources.engine_dead = True
    processor = getattr(engine, "output_processor", None)
    if processor is not None:
        error = EngineDeadError()
        error.args = (f"engine dead: {cause}",)   # vLLM's own text says nothing of the cause
        try:
            processor.propagate_error(error)
        except Exception:   # best effort: the calls in flight also end at their deadlines
            log.exception("failing the requests in flight of a dead engine")
    shutdown(engine)


async def warmup(engine: Any) -> None:
    """Short requests through the whole path, so that no client request pays for what vLLM compiles
    on first use (6-12 s on our CPUs). The engine core compiles as it steps, so every request of the
    engine would wait meanwhile: a greedy one, and one sampled at random (vLLM's random sampler is
    compiled at its first unseeded use: 5-6 s here, during which every stream stood still)."""
    from vllm import PoolingParams, SamplingParams

    tasks = tuple(await engine.get_supported_tasks())
    n = next(_warmups)
    # Token ids, not text (an engine made with skip_tokenizer_init takes no text), as many as the
    # engine's length leaves room for beside what they generate (a client may make one of 2 tokens).
    room = int(getattr(getattr(engine, "model_config", None), "max_model_len", 0) or 0)
    if room < 2:
        return          # nothing can be generated: no request could pay for a compile either
    prompt = {"prompt_token_ids": [1] * min(4, room - 1)}
    gen = min(4, room - len(prompt["prompt_token_ids"]))
    if "generate" in tasks:
        sources = [engine.generate(prompt, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True),
                                   f"bridge-warmup-{n}"),
                   engine.generate(prompt, SamplingParams(max_tokens=min(2, gen), temperature=1.0, ignore_eos=True),
                                   f"bridge-warmup-{n}-sampled")]
    else:
        task = next((t for t in ("embed", "classify", "score", "token_embed", "token_classify")
                     if t in tasks), None)
        if task is None:
            return
        pooled = PoolingParams(task=task)  # type: ignore[arg-type]
        sources = [engine.encode(prompt, pooled, f"bridge-warmup-{n}")]

    async def drain(source: Any) -> None:
        async for _ in source:
            pass
    await asyncio.gather(*(drain(source) for source in sources))


def started(engine: Any) -> None:
    """vLLM reads some environment variables again at every use unless told to cache them, which its
    own engine processes do once started. Its front-end in the worker reads one per request per engine
    step (`VLLM_COMPUTE_NANS_IN_LOGITS`, in its stats): 1.6 % of the worker's samples while it streams.
    Nothing changes the environment of a worker once it runs, so it is cached from here on.

    And an engine that logs stats records them, at every engine step, for its Prometheus metrics too
    (a histogram observation per token among them), into this process's default registry, which no
    one reads: the worker serves no metrics of its own (the pool server's are in a registry of their
    own). That logger goes; the stats themselves stay (each output's `metrics`, and `do_log_stats`)."""
    from vllm.envs import enable_envs_cache
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    enable_envs_cache()
    manager = getattr(engine, "logger_manager", None)
    loggers = getattr(manager, "stat_loggers", None)
    if isinstance(loggers, list):
        loggers[:] = [x for x in loggers if not isinstance(x, PrometheusStatLogger)]


def shutdown(engine: Any) -> None:
    """Last ref released: stop the engine core process. Off the event loop, as shutdown blocks."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        _stop(engine)
        return
    loop.run_in_executor(None, _stop, engine)


def _stop(engine: Any, reap_s: float = 5.0) -> None:
    """vLLM's shutdown, then the exit of its core collected: one that did not stop when asked (a
    stopped or wedged core) is killed, but not waited for, and stayed a zombie for the worker's life,
    one more for every engine created again."""
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    cores = {p.pid for p in getattr(manager, "processes", None) or ()}
    engine.shutdown()
    until = time.monotonic() + reap_s
    # each look collects the children that have exited (multiprocessing's own bookkeeping)
    while cores & {p.pid for p in multiprocessing.active_children()} and time.monotonic() < until:
        time.sleep(0.1)
