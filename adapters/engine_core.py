"""What runs inside vLLM's engine core process, loaded there by `bridge_server/cli.py` (the module the
spawned core imports as its main) and by a worker whose engine runs in its own process.

Why: some of vLLM's CPU paths fail on requests that are valid, and a failure there kills the engine
core, which every client of the worker shares. What is fixed here is fixed where it happens; the
requests stay as they are.

- Structured outputs beside plain requests. When an engine step holds rows with a grammar and rows
  without, vLLM hands xgrammar the list of grammar rows as a tensor in pinned memory, which needs a
  CUDA driver: on a CPU engine every such step raised, and the core died (any structured request
  that shared a step with any other request did it, at will). A grammar-less row's mask allows
  every token, so the mask is applied to every row here: each row not in the grammar output gets a
  row of ones, and vLLM then takes its path for a mask that covers the whole batch, which pins
  nothing. Logits of those rows are unchanged.
- A grammar's cost per token. The core works out each structured request's mask of allowed tokens,
  and advances its grammar, on the step thread every request of the engine waits on, and an
  ambiguous grammar's cost grows with every token (16 sequences of one stopped every request of
  the engine for 5 minutes). The worker tries each new grammar first (`grammar_check.py`), but a
  trial follows one path through a grammar, and a grammar can be cheap on that path and costly on
  another. So the core times every grammar's mask and step, and a sequence whose grammar has cost
  more than GRAMMAR_STEP_S a token, over its last GRAMMAR_WINDOW // 2 tokens (or as many as it has
  generated), ends there: finish reason `abort`, its stop reason saying why. Judged from the first
  token on: a grammar can be costly from there (sequences of 7 tokens, ended by nothing, made each
  step ~4 s when the first 8 tokens went unjudged). What is timed is the thread's own CPU time: a
  stall while the thread waited for a core or the interpreter lock is not the grammar's (a 3-token
  `[0-9]{3}` was ended at "13.2 ms a token" once, on wall-clock time over its 2-6 calls). No call is
  left out as an outlier: a grammar whose mask alone blows up at some token shows it in one call
  of two, and leaving the dearest out cost one more step, dearer than the one before (a bystander's
  worst wait went from ~1.6 to ~3 s). Many sequences each under that bound add up
  (64 at ~9 ms made every step of the engine ~0.6 s longer): when the grammars of one step's
  sequences together cost more than GRAMMAR_STEP_BUDGET_S, the costliest of them, those past
  GRAMMAR_FLOOR_S a token (a hundred times a JSON schema's), end the same way until the rest fit.
- A sequence at the model's length ends, whatever its `min_tokens` (`stop_bounded`).
- A core that fails to start says why to the worker that started it (`_StartFailure`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import logging
import os
import stat
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["CORE_REPORTS_ENV", "END_PREFIX", "GRAMMAR_STEP_BUDGET_S", "GRAMMAR_STEP_S", "grammar_cost", "install",
           "mask_every_row", "share_grammar_time", "stop_bounded", "timed_grammar"]

# Where the worker has its engine cores write why one failed to start (a folder the first failing
# core makes, one file a core, named by the worker's pid and the core's; the worker removes both as
# it reads them), what vLLM logs then, and how much of it is kept.
CORE_REPORTS_ENV = "VLLM_BRIDGE_CORE_REPORTS"
START_FAILED_LOG = "EngineCore failed to start."
START_FAILURE_CHARS = 600

# What a grammar may cost the engine core a token (its mask and its step), as the mean over its
# last GRAMMAR_WINDOW calls (two a token): 5 times what the worker's trial allows, 1,000 times a JSON
# schema's on a small vocabulary.
GRAMMAR_STEP_S = 0.01
GRAMMAR_WINDOW = 16
# What the grammars of one step's sequences may cost together, and the least a sequence's grammar
# costs a token before it can be ended to keep them within it.
GRAMMAR_STEP_BUDGET_S = 0.02
GRAMMAR_FLOOR_S = 0.0005
# How the stop reason of a sequence ended here for its grammar's cost begins (the worker's front-end
# looks for it: `grammar_ends.py`). The core sets no other string stop reason; a stop string is the
# front-end's.
END_PREFIX = "vllm-bridge: "


def mask_every_row(apply: Callable[..., None]) -> Callable[..., None]:
    """vLLM's `apply_grammar_bitmask`, given a grammar output that covers every row of the step
    (rows of ones for the requests without a grammar), so that the bitmask spans the batch."""
    @functools.wraps(apply)
    def apply_to_every_row(scheduler_output: Any, grammar_output: Any, input_batch: Any, logits: Any) -> None:
        import numpy as np
        listed = set(grammar_output.structured_output_request_ids)
        others = [r for r in input_batch.req_ids if r is not None and r not in listed]
        if others:
            spec = scheduler_output.scheduled_spec_decode_tokens
            rows = len(input_batch.req_ids) + sum(len(spec.get(r, ())) for r in input_batch.req_ids if r is not None)
            if rows == logits.shape[0]:     # else the batch is not what we take it for: vLLM's own way
                mask = grammar_output.grammar_bitmask
                extra = sum(1 + len(spec.get(r, ())) for r in others)
                ones = np.full((extra, mask.shape[1]), -1, dtype=mask.dtype)
                grammar_output = dataclasses.replace(
                    grammar_output,
                    structured_output_request_ids=[*grammar_output.structured_output_request_ids, *others],
                    grammar_bitmask=np.concatenate([mask, ones]))
        apply(scheduler_output, grammar_output, input_batch, logits)
    return apply_to_every_row


def timed_grammar(method: Callable[..., Any]) -> Callable[..., Any]:
    """A grammar's `fill_bitmask` or `accept_tokens`, its cost kept on the grammar (the CPU time of
    its last GRAMMAR_WINDOW calls, on whichever thread ran each)."""
    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            kept = getattr(self, "__dict__", None)      # None: a grammar with slots, not timed
            if kept is not None:
                costs = kept.get("_bridge_costs")
                if costs is None:
                    costs = kept["_bridge_costs"] = collections.deque(maxlen=GRAMMAR_WINDOW)
                costs.append(time.thread_time() - started)
    return timed


def grammar_cost(grammar: Any) -> float | None:
    """What a grammar has cost a token lately: its last GRAMMAR_WINDOW calls, or as many as it has
    had (judged from its first token's mask on, since a grammar can be costly from there, and
    sequences ended only after 8 tokens let a step cost seconds)."""
    costs = getattr(grammar, "__dict__", {}).get("_bridge_costs")
    if not costs:
        return None
    return 2 * sum(costs) / len(costs)


def _grammar_of(request: Any) -> Any:
    grammar = getattr(getattr(request, "structured_output_request", None), "_grammar", None)
    return None if isinstance(grammar, Future) else grammar


def share_grammar_time(grammar_bitmask: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's `StructuredOutputManager.grammar_bitmask` (once a step, over the step's structured
    sequences), which first marks the costliest sequences to end when their grammars together cost
    more than GRAMMAR_STEP_BUDGET_S a step."""
    @functools.wraps(grammar_bitmask)
    def within_budget(self: Any, requests: Any, structured_output_request_ids: Any, *args: Any, **kwargs: Any) -> Any:
        costs = []
        for rid in structured_output_request_ids:
            grammar = _grammar_of(requests.get(rid))
            cost = grammar_cost(grammar) if grammar is not None else None
            if cost is not None:
                costs.append((cost, grammar))
        total = sum(cost for cost, _ in costs)
        if total > GRAMMAR_STEP_BUDGET_S:
            step = total
            for cost, grammar in sorted(costs, key=lambda c: c[0], reverse=True):
                if total <= GRAMMAR_STEP_BUDGET_S or cost <= GRAMMAR_FLOOR_S:
                    break
                grammar.__dict__["_bridge_end"] = (
                    f"{END_PREFIX}its structured output's grammar cost the engine {cost * 1000:.2f} ms a token, "
                    f"the costliest of a step whose grammars cost {step * 1000:.1f} ms together, over the limit of "
                    f"{GRAMMAR_STEP_BUDGET_S * 1000:g} ms (every request of the engine waits on that work)")
                total -= cost
        return grammar_bitmask(self, requests, structured_output_request_ids, *args, **kwargs)
    return within_budget


def stop_bounded(check_stop: Callable[..., bool]) -> Callable[..., bool]:
    """vLLM's `check_stop`, bounded two ways.
    - A sequence at max_model_len ends (length capped), whatever its `min_tokens`: vLLM's own check
      returns before its length cap while min_tokens is unmet, and its scheduler gives such a
      sequence no more tokens, so it held its seat in the batch for ever (the worker refuses such
      requests first, `request_building._check_room`; this is where the engine itself cannot be held).
    - A request whose grammar costs more than GRAMMAR_STEP_S a token, or was marked to end by
      `share_grammar_time`, ends as an abort, which the front-end reports like any other end."""
    @functools.wraps(check_stop)
    def check_stop_or_costly(request: Any, max_model_len: int) -> bool:
        if check_stop(request, max_model_len):
            return True
        if request.num_tokens >= max_model_len:
            from vllm.v1.request import RequestStatus
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        grammar = _grammar_of(request)
        if grammar is None:
            return False
        why = getattr(grammar, "__dict__", {}).get("_bridge_end")
        cost = grammar_cost(grammar)
        if why is None and cost is not None and cost > GRAMMAR_STEP_S:
            why = (f"{END_PREFIX}its structured output's grammar cost the engine {cost * 1000:.1f} ms a token, over "
                   f"the limit of {GRAMMAR_STEP_S * 1000:g} ms (every request of the engine waits on that work)")
        if why is None:
            return False
        from vllm.v1.request import RequestStatus
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = why
        return True
    return check_stop_or_costly


def _install_grammar_costs() -> None:
    for module, name in (("backend_xgrammar", "XgrammarGrammar"), ("backend_guidance", "GuidanceGrammar"),
                         ("backend_outlines", "OutlinesGrammar"),
                         ("backend_lm_format_enforcer", "LMFormatEnforcerGrammar")):
        try:
            cls = getattr(importlib.import_module(f"vllm.v1.structured_output.{module}"), name)
        except (ImportError, AttributeError):      # a backend whose library is not installed
            continue
        for method in ("fill_bitmask", "accept_tokens"):
            current = getattr(cls, method)
            if getattr(current, "__wrapped__", None) is None:
                setattr(cls, method, timed_grammar(current))
    manager = importlib.import_module("vllm.v1.structured_output").StructuredOutputManager
    if getattr(manager.grammar_bitmask, "__wrapped__", None) is None:
        manager.grammar_bitmask = share_grammar_time(manager.grammar_bitmask)
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    current = getattr(scheduler, "check_stop")     # noqa: B009 - a module global the scheduler looks up per token
    if getattr(current, "__wrapped__", None) is None:
        setattr(scheduler, "check_stop", stop_bounded(current))    # noqa: B010


class _StartFailure(logging.Handler):
    """Writes why this engine core failed to start where the worker that started it reads it
    (`CORE_REPORTS_ENV`; `engine_making.core_start_named`). vLLM says it only in the core's log, and
    the worker gets a RuntimeError that names nothing ("Engine core initialization failed. See root
    cause above"): a client whose arguments passed the configuration's checks but not the model's
    loading (a quantization its checkpoint lacks) learnt nothing of what to change."""

    def __init__(self, where: str) -> None:
        super().__init__(logging.ERROR)
        self.where = where

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg != START_FAILED_LOG or not record.exc_info or record.exc_info[1] is None:
            return
        exc = record.exc_info[1]
        path = os.path.join(self.where, f"{os.getppid()}-{os.getpid()}")
        try:
            os.makedirs(self.where, mode=0o700, exist_ok=True)
            folder = os.lstat(self.where)
            if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.getuid():
                return          # not ours (a link or another user's, in a shared temporary folder)
            fd = os.open(path + ".part", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(_said(exc)[:START_FAILURE_CHARS])
            os.replace(path + ".part", path)
        except OSError:         # nowhere to write it: the worker's log still has it
            pass


def _said(exc: BaseException) -> str:
    """An exception as a line: its type and text, or, for one with no text (vLLM's bare asserts),
    the check it tripped, where."""
    text = str(exc)
    if not text and exc.__cause__ is not None and str(exc.__cause__):
        return f"{type(exc).__name__}: {_said(exc.__cause__)}"
    if not text:
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            last = frames[-1]
            text = f"with no message, at {os.path.basename(last.filename)}:{last.lineno}: {last.line}"
    return f"{type(exc).__name__}: {text}"


def install() -> None:
    """Puts the fixes above in place of vLLM's functions, where vLLM looks them up (module globals
    and classes). The grammar mask's fix without a CUDA driver only: on a GPU vLLM's path works."""
    _install_grammar_costs()
    where = os.environ.get(CORE_REPORTS_ENV)
    if where:       # (once vLLM has configured its logging, which drops its loggers' handlers)
        import vllm.logger  # noqa: F401
        logging.getLogger("vllm.v1.engine.core").addHandler(_StartFailure(where))
    import torch
    if torch.cuda.is_available():
        return
    runner = importlib.import_module("vllm.v1.worker.gpu_model_runner")
    current = getattr(runner, "apply_grammar_bitmask")     # noqa: B009 - a module global the runner looks up per step
    if getattr(current, "__wrapped__", None) is None:
        setattr(runner, "apply_grammar_bitmask", mask_every_row(current))   # noqa: B010
