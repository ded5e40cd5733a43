"""Errors as the client sees them: a gRPC status plus a structured `ErrorDetail`.

Every failure leaves the server as a `BridgeError`, so the status code and category are decided in
one place and a client can act on `category`/`reason` without parsing messages. Details travel in
the standard rich error model (`grpc-status-details-bin`), which stock gRPC tooling understands.

Error texts are bounded where they leave (`detail`, `to_status`, `to_mux_error`): a message may quote
what a client sent (a 9,000-character name, a vLLM error that repeats the prompt), and trailers over
gRPC's metadata limit (8 KiB by default) make the client see RESOURCE_EXHAUSTED, or, in some stacks,
nothing until its deadline. Call sites quote client input with `quote`, which keeps a short prefix.
"""

from __future__ import annotations

import collections
import errno
import functools
import inspect
import logging
import os
import re
import sys
import traceback as tb
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status

from vllm_bridge.v1 import bridge_pb2 as pb

log = logging.getLogger("vllm_bridge.worker")

# The trailer of the standard rich error model.
STATUS_DETAILS_KEY = "grpc-status-details-bin"
# The reason of a call given up at its deadline whose work goes on in a thread of the worker, which
# nothing can stop (a rank waiting in C code for peers): a pool restarts a group for it.
STILL_RUNNING = "still running"

# What an error may carry, in characters (an event of a Multiplex stream carries all of it).
MAX_MESSAGE_CHARS = 1000
MAX_TRACEBACK_CHARS = 3000
MAX_FIELD_CHARS = 200
QUOTE_CHARS = 80
# What a status's trailers may take together, in bytes as they travel: the message percent-encoded
# (three bytes for each byte past ASCII) in the status line, and again, with the detail, in the
# base64 of grpc-status-details-bin. gRPC's C core refuses metadata past 8 KiB at random (a soft
# limit, with RESOURCE_EXHAUSTED "Stream removed") and always past 16 KiB: characters are not bytes,
# so the bound is kept in bytes, with room left for the other trailers.
MAX_STATUS_BYTES = 6 * 1024


def clip(text: str, limit: int) -> str:
    """`text` within `limit` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    note = f"... [{len(text) - limit} more characters]"
    return text[:max(0, limit - len(note))] + note


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """A client's value as an error message quotes it: its repr, cut to a short prefix."""
    try:
        text = repr(value)
    except Exception:   # a repr that fails must not turn a refusal into a crash
        text = f"<{type(value).__qualname__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def without_addresses(text: str) -> str:
    """A repr (or a message quoting one) without the memory addresses default reprs show
    ("<function f at 0x7f30...>"): where the heap lies is nothing a client needs, and it is what
    defeats address randomization."""
    return _ADDRESS.sub("", text) if " at 0x" in text else text


_ENGINE_CORE_FAILED = re.compile(r"Call to \w+ method failed: ")   # vLLM's core, on a method it ran


# Python exception types whose meaning maps onto a more specific status than UNKNOWN.
_PY_STATUS: dict[str, grpc.StatusCode] = {
    "ValueError": grpc.StatusCode.INVALID_ARGUMENT,
    "TypeError": grpc.StatusCode.INVALID_ARGUMENT,
    "KeyError": grpc.StatusCode.INVALID_ARGUMENT,
    "IndexError": grpc.StatusCode.INVALID_ARGUMENT,
    "AssertionError": grpc.StatusCode.FAILED_PRECONDITION,
    "NotImplementedError": grpc.StatusCode.UNIMPLEMENTED,
    "TimeoutError": grpc.StatusCode.DEADLINE_EXCEEDED,
    "EngineDeadError": grpc.StatusCode.UNAVAILABLE,
    "DistNetworkError": grpc.StatusCode.FAILED_PRECONDITION,  # a rendezvous' port in use, a peer not there
    "MemoryError": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "ArithmeticError": grpc.StatusCode.INVALID_ARGUMENT,     # division by zero, overflow: of the arguments given
    "ImportError": grpc.StatusCode.FAILED_PRECONDITION,      # what the call needs is not installed here (ray)
}
# torch says what went wrong only in a RuntimeError's text. Its checks of the arguments are told
# apart by where they were raised (`_raised_natively`); what it says of the worker's own state
# (memory, a device or process group the call names and this worker lacks) is matched here first,
# as is what vLLM says of a group's state in a ValueError (a CPU group has no device communicator).
_TORCH_STATUS = (("Trying to create tensor with negative dimension", grpc.StatusCode.INVALID_ARGUMENT),
                 ("No device communicator", grpc.StatusCode.FAILED_PRECONDITION),
                 # a Rust tokenizer in use by another thread at that moment: the call was fine, try again
                 ("Already borrowed", grpc.StatusCode.UNAVAILABLE),
                 ("can't allocate memory", grpc.StatusCode.RESOURCE_EXHAUSTED),
                 ("Could not resolve the process group", grpc.StatusCode.FAILED_PRECONDITION),
                 ("exchangeDevice", grpc.StatusCode.FAILED_PRECONDITION),
                 ("No CUDA GPUs are available", grpc.StatusCode.FAILED_PRECONDITION),
                 ("Found no NVIDIA driver", grpc.StatusCode.FAILED_PRECONDITION),
                 ("not compiled with CUDA", grpc.StatusCode.FAILED_PRECONDITION),
                 ("out of memory", grpc.StatusCode.RESOURCE_EXHAUSTED))


@dataclass
class BridgeError(Exception):
    code: grpc.StatusCode
    category: str
    message: str
    target: str = ""
    parameter: str = ""
    reason: str = ""
    python_type: str = ""
    traceback: str = ""
    suggestions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    # Constructors for the common cases keep call sites short and the categories consistent.
    @classmethod
    def validation(cls, message: str, *, target: str = "", parameter: str = "") -> BridgeError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, "validation", message, target=target, parameter=parameter)

    @classmethod
    def not_found(cls, message: str, *, target: str = "", suggestions: list[str] | None = None) -> BridgeError:
        return cls(grpc.StatusCode.NOT_FOUND, "validation", message, target=target,
                   suggestions=list(suggestions or []))

    @classmethod
    def timeout(cls, message: str, *, target: str = "") -> BridgeError:
        return cls(grpc.StatusCode.DEADLINE_EXCEEDED, "timeout", message, target=target, reason="deadline exceeded")

    @classmethod
    def from_exception(cls, exc: BaseException, target: str, pure: bool = False) -> BridgeError:
        """Wraps an exception raised by the called Python code, keeping its type and traceback.
        `pure`: the code is a function of its arguments alone (an inline helper), so a failed
        assertion is about them (INVALID_ARGUMENT), not about the state of anything.

        The frames the exception went through are let go of once it is told (their text is kept):
        they held what the failed code had made, until a collection found the cycle they are in
        (a fake matmul refused after multiplying kept its 2 GB result 15 s and more)."""
        if isinstance(exc, BridgeError):
            return exc
        try:
            return cls._told(exc, target, pure)
        finally:
            _clear_locals(exc)

    @classmethod
    def _told(cls, exc: BaseException, target: str, pure: bool) -> BridgeError:
        py_type = type(exc).__name__
        text = without_addresses(str(exc))
        code = grpc.StatusCode.INVALID_ARGUMENT if pure and isinstance(exc, AssertionError) else _py_status(exc)
        cause = exc.__cause__
        refusal = exc if text or cause is None else cause      # a wrapper with nothing to say: its cause
        named = getattr(refusal, "parameter", None)
        if isinstance(refusal, ValueError) and isinstance(named, str) and named:
            # vLLM's request checks name what they refused (VLLMValidationError): a refusal of an
            # argument like ours, which says which one, and that the rule is vLLM's.
            shown, said = clip(named, 80), without_addresses(str(refusal.args[0]) if refusal.args else str(refusal))
            return cls(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                       f"{target}: parameter {shown}: vLLM refused it: {clip(said, 600)}{_value_shown(refusal)}",
                       target=target, parameter=shown, python_type=type(refusal).__name__)
        if not text and cause is not None and not isinstance(cause, BridgeError):
            # A wrapper with nothing to say (vLLM's EngineGenerateError raised `from` what failed):
            # what failed is the message, and its kind the status, unless the wrapper has its own.
            text = f"{type(cause).__name__}: {without_addresses(str(cause))}" if str(cause) else type(cause).__name__
            if code is grpc.StatusCode.UNKNOWN:
                code = _py_status(cause)
        if not text:
            # vLLM raises bare AssertionErrors; say which call failed and which check it tripped.
            frames = tb.extract_tb(exc.__traceback__)
            where = f" at {_importable(frames[-1].filename)}:{frames[-1].lineno}: {frames[-1].line}" if frames else ""
            text = f"{py_type} with no message{where}"
        core_said = _ENGINE_CORE_FAILED.match(text) if py_type == "Exception" else None
        if core_said is not None:
            # An engine method vLLM runs in its core process ("Call to profile method failed:
            # Profiler is not enabled."): the core sends only the text, so the kind of failure is
            # lost; what the engine refused in its state is FAILED_PRECONDITION, not UNKNOWN.
            return cls(grpc.StatusCode.FAILED_PRECONDITION, "engine",
                       f"{target}: the engine core refused it: {text[core_said.end():]}", target=target,
                       python_type=py_type, traceback=_traceback(exc), reason="engine core refused")
        dead = py_type == "EngineDeadError"    # the engine, not the call, failed: say so the same way every time
        return cls(code, "engine" if dead else "python_error", f"{target}: {py_type}: {text}", target=target,
                   python_type=py_type, traceback=_traceback(exc),
                   reason="engine dead" if dead else "")

    def detail(self) -> pb.ErrorDetail:
        """The structured detail, every text within its bound (the traceback keeps its end, where
        the failing frame is)."""
        tb_text = self.traceback
        if len(tb_text) > MAX_TRACEBACK_CHARS:
            tb_text = f"[{len(tb_text) - MAX_TRACEBACK_CHARS} characters left out]\n" + tb_text[-MAX_TRACEBACK_CHARS:]
        return pb.ErrorDetail(category=_utf8(clip(self.category, MAX_FIELD_CHARS)),
                              python_type=_utf8(clip(self.python_type, MAX_FIELD_CHARS)),
                              message=_utf8(clip(self.message, MAX_MESSAGE_CHARS)), traceback=_utf8(tb_text),
                              target=_utf8(clip(self.target, MAX_FIELD_CHARS)),
                              parameter=_utf8(clip(self.parameter, MAX_FIELD_CHARS)),
                              reason=_utf8(clip(self.reason, MAX_FIELD_CHARS)),
                              suggestions=[_utf8(clip(s, MAX_FIELD_CHARS)) for s in self.suggestions[:5]])

    def to_mux_error(self) -> pb.MuxError:
        """The same failure as one event of a Multiplex stream."""
        return pb.MuxError(code=self.code.value[0], message=_utf8(clip(self.message, MAX_MESSAGE_CHARS)),
                           detail=self.detail())

    def to_status(self) -> grpc.Status:
        return fitted_status(self.code.value[0], clip(self.message, MAX_MESSAGE_CHARS), self.detail())


# An OSError's errno that says a resource ran out (files, memory, disk), not that the call was wrong.
_EXHAUSTED_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC})


def _value_shown(exc: BaseException) -> str:
    """What the refused value was, as vLLM recorded it (it may be what it made of the client's: -1
    logprobs is the whole vocabulary)."""
    value = getattr(exc, "value", None)
    return "" if value is None else f" (the value it checked: {quote(value, 80)})"


# Code whose frames belong to a generator or coroutine: clearing such a frame closes its generator,
# which may be alive (one that caught the exception, kept it, and went on).
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _clear_locals(exc: BaseException | None) -> None:
    """Clears the locals of the finished function frames an exception (and what it was raised from)
    went through. Frames still running, on any thread, refuse to be cleared and are left as they
    are; so are generators' and coroutines'."""
    for _ in range(8):
        if exc is None:
            return
        entry = exc.__traceback__
        while entry is not None:
            frame = entry.tb_frame
            if not frame.f_code.co_flags & _RESUMABLE:
                try:
                    frame.clear()
                except RuntimeError:
                    pass
            entry = entry.tb_next
        exc = exc.__cause__ or exc.__context__


def _traceback(exc: BaseException) -> str:
    """The exception's traceback, each file named as it is imported (`vllm/v1/engine/async_llm.py`),
    not by where the server keeps it: a caller debugging its call needs the frames, and no stranger
    needs the server's directories."""
    shown = tb.TracebackException.from_exception(exc)
    seen: set[int] = set()
    pending = [shown]
    while pending:
        each = pending.pop()
        if id(each) in seen:
            continue
        seen.add(id(each))
        for frame in each.stack:
            frame.filename = _importable(frame.filename)
        pending += [e for e in (each.__cause__, each.__context__, *(getattr(each, "exceptions", None) or ()))
                    if e is not None]
    return "".join(shown.format())


def _importable(path: str) -> str:
    """A source file's path from the import root it lies under (the last part of it, if none)."""
    for root in _import_roots():
        if path.startswith(root):
            return path[len(root):]
    return os.path.basename(path)


@functools.lru_cache(maxsize=1)
def _import_roots() -> tuple[str, ...]:
    roots = {os.path.join(os.path.abspath(p), "") for p in sys.path if p and os.path.isdir(p)}
    return tuple(sorted(roots, key=len, reverse=True))


def _py_status(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, OSError) and exc.errno in _EXHAUSTED_ERRNOS:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, NotImplementedError) and "not implemented for '" in str(exc):
        return grpc.StatusCode.INVALID_ARGUMENT      # torch: an op given a dtype it has no kernel for
    if type(exc) is RuntimeError or type(exc) is ValueError:
        text = str(exc)
        code = next((c for said, c in _TORCH_STATUS if said in text), None)
        if code is not None:
            return code
        if type(exc) is RuntimeError and _raised_natively(exc):
            return grpc.StatusCode.INVALID_ARGUMENT
    return next((c for t in type(exc).__mro__ if (c := _PY_STATUS.get(t.__name__))), grpc.StatusCode.UNKNOWN)


# What the interpreter and asyncio raise as plain RuntimeErrors from native code: the server's own
# state (a race, a loop shut down), never the arguments' fault.
_INTERPRETER_STATE = ("changed size during iteration", "mutated during iteration", "already executing",
                      "already awaited", "GeneratorExit", "event loop", "Event loop", "different loop",
                      "can only be started once", "cannot schedule new futures", "bad yield")


def _raised_natively(exc: BaseException) -> bool:
    """Whether native code raised it about what it was given (the last Python frame is a call, not a
    `raise`): torch's checks of the tensors it is given (TORCH_CHECK: "mat2 must be a matrix",
    "Expected mat1 to be Float8") raise plain RuntimeErrors, about the arguments; the states torch
    reports so are matched by text before (_TORCH_STATUS), the interpreter's by _INTERPRETER_STATE.
    A RuntimeError raised in Python says nothing of whose fault it is."""
    frames = tb.extract_tb(exc.__traceback__)
    text = str(exc)
    return bool(frames) and not (frames[-1].line or "").lstrip().startswith("raise") and \
        not any(said in text for said in _INTERPRETER_STATE)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """A status code from its number (UNKNOWN for a number gRPC does not define)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def mux_error_status(err: pb.MuxError) -> grpc.Status:
    """A Multiplex event's failure as the status the same call would have ended with on its own."""
    detail = pb.ErrorDetail()
    detail.CopyFrom(err.detail)
    return fitted_status(status_code(err.code).value[0], err.message, detail)


def fitted_status(code: int, message: str, detail: pb.ErrorDetail) -> grpc.Status:
    """The rich status, within MAX_STATUS_BYTES: what gives way first is the traceback (its start:
    the failing frame is at its end), then the suggestions, then the message, then the short fields.
    `detail` is the caller's to give up (it is cut in place)."""
    message = _utf8(message)
    while (size := _status_bytes(code, message, detail)) > MAX_STATUS_BYTES:
        over = size - MAX_STATUS_BYTES
        if len(detail.traceback) > 64:
            keep = max(0, len(detail.traceback) - max(over, len(detail.traceback) // 2))
            detail.traceback = f"[{len(detail.traceback) - keep} characters left out]\n" + detail.traceback[-keep:] \
                if keep else ""
        elif detail.suggestions:
            del detail.suggestions[:]
        elif max(len(message), len(detail.message)) > 64:
            message = clip(message, max(64, len(message) // 2))
            detail.message = clip(detail.message, max(64, len(detail.message) // 2))
        elif any(len(getattr(detail, f)) > 64 for f in _SHORT_FIELDS):
            for f in _SHORT_FIELDS:
                setattr(detail, f, clip(getattr(detail, f), 64))
        else:
            detail.traceback = ""
            break       # a few short texts: well within the bound, whatever they hold
    packed = any_pb2.Any()
    packed.Pack(detail)
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=[packed]))


_SHORT_FIELDS = ("category", "python_type", "target", "parameter", "reason")


def _utf8(text: str) -> str:
    """`text` as it can travel: a lone surrogate (an OS error's undecodable file name) fails to encode."""
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()


def _status_bytes(code: int, message: str, detail: pb.ErrorDetail) -> int:
    packed = any_pb2.Any()
    packed.Pack(detail)
    details = status_pb2.Status(code=code, message=message, details=[packed]).ByteSize()
    encoded = message.encode()
    return len(encoded) + 2 * sum(1 for b in encoded if not 0x20 <= b <= 0x7E or b == 0x25) + 4 * -(-details // 3)


def target_label(target: pb.Target) -> str:
    """How errors name a call's target: its name (cut short), or its kind when it has none (ITERATE
    on a ref); a kind this server does not know is named by its number."""
    if target.name:
        return clip(target.name, QUOTE_CHARS)
    try:
        return pb.Target.Kind.Name(target.kind)
    except ValueError:
        return f"target kind {target.kind}"


def server_error(exc: BaseException, label: str) -> BridgeError:
    """What a worker reports for any exception while serving `label`: bad values are the caller's
    fault (INVALID_ARGUMENT, naming where), anything unforeseen is the worker's (INTERNAL, logged)."""
    from bridge_server.wire.codec import CodecError  # here, not at the top: clients import this module too

    if isinstance(exc, BridgeError):
        return exc
    if isinstance(exc, CodecError):
        return BridgeError.validation(f"{label}: {exc}", target=label, parameter=exc.path)
    log.exception("unexpected failure in %s", label)
    err = BridgeError.from_exception(exc, label)
    err.category = "worker"
    err.code = grpc.StatusCode.INTERNAL
    return err


def caller_gone(exc: BaseException) -> bool:
    """Whether exc is gRPC refusing a send on an RPC that has ended: its caller went away (it
    cancelled, its deadline passed, its connection dropped; gRPC's core says so before the RPC reads
    as cancelled), or the message was over the send limit, when gRPC itself ends the call with
    RESOURCE_EXHAUSTED. Either way there is nobody to tell more, and a second abort would fail."""
    return type(exc).__name__ == "ExecuteBatchError" or isinstance(exc, grpc.aio.UsageError)


def detail_from_rpc_error(err: grpc.RpcError) -> pb.ErrorDetail | None:
    """The ErrorDetail a bridge server attached to a failed call, if any (client side).

    The trailer is read directly rather than through `rpc_status.from_call`, which raises when the
    status line differs from the rich status: that happens when the caller's own deadline fires
    while the server's named deadline error is already on its way, and the call must still end in
    a clean `CallError` carrying the server's detail.
    """
    raw = next((value for key, value in err.trailing_metadata() or ()  # type: ignore[attr-defined]
                if key == STATUS_DETAILS_KEY), None)
    if raw is None:
        return None
    status = status_pb2.Status.FromString(raw)
    for any_msg in status.details:
        if any_msg.Is(pb.ErrorDetail.DESCRIPTOR):
            detail = pb.ErrorDetail()
            any_msg.Unpack(detail)
            return detail
    return None


async def abort(context: grpc.aio.ServicerContext, status: grpc.Status, cause: BaseException | None = None) -> NoReturn:
    """Ends the RPC with `status`, as `abort_with_status` does, without keeping what its handler held.
    `cause`: the exception the status was made from, if one is being handled.

    Why: gRPC keeps the AbortError it raises with the RPC's state, and the exception's traceback holds
    the handler's frames, which hold the RPC's context, which holds that state: a cycle, freed only by
    a collection (rare in an idle server), and with it every frame's locals (the request's bytes, and
    through the error being handled, the frames that refused them). A stranger's refused 60 MB
    requests each stayed that long: 120 MB per health check, 60 MB per Call, a gigabyte and more before
    a collection came. So once the RPC is done the exception lets go of its frames; and the cause lets
    go of its own at once (an error raised from a variable, `raise error`, is in a cycle with the frame
    that holds it: a refused Collective's 60 MB stayed so)."""
    forget_frames(cause)
    try:
        await context.abort_with_status(status)
    except grpc.aio.AbortError as stop:
        context.add_done_callback(functools.partial(_let_go, stop))
        raise
    raise AssertionError("abort_with_status returned")     # (it always raises)


def _let_go(stop: BaseException, _: object) -> None:
    forget_frames(stop)


def forget_frames(exc: BaseException | None) -> None:
    """Drops the tracebacks of an exception and of those it chains (once its status is made from them)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chained = exc.__cause__ or exc.__context__
        exc.__traceback__ = None
        exc.__cause__ = exc.__context__ = None
        exc = chained


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    pass


def status_of(code: grpc.StatusCode, details: str, trailing_metadata: tuple[Any, ...] = ()) -> grpc.Status:
    """A plain status (no rich detail), for `abort`."""
    return _Status(code, details, trailing_metadata)
