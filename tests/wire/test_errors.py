"""The client's reading of a failed call (`bridge_server/wire/errors.py`), over a real gRPC socket."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf import any_pb2
from google.rpc import status_pb2

from bridge_server.client.client import CallError
from bridge_server.wire.errors import STATUS_DETAILS_KEY, BridgeError
from vllm_bridge.v1 import bridge_pb2 as pb

METHOD = "/test.Errors/Fail"
DETAIL = pb.ErrorDetail(category="timeout", target="vllm.AsyncLLMEngine.generate")


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Any) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def _rich(message: str) -> bytes:
    packed = any_pb2.Any()
    packed.Pack(DETAIL)
    return status_pb2.Status(code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message=message,
                             details=[packed]).SerializeToString()


def _fail(request: bytes, context: grpc.ServicerContext) -> bytes:
    """Ends with a rich status whose message is the request's text, and a status line of its own."""
    context.abort_with_status(_Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded",
                                      ((STATUS_DETAILS_KEY, _rich(request.decode())),)))
    raise AssertionError("abort_with_status returned")


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler("test.Errors", {"Fail": grpc.unary_unary_rpc_method_handler(_fail)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _call_error(address: str, message: str) -> CallError:
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(METHOD)(message.encode(), timeout=5)
    return CallError(caught.value)  # type: ignore[arg-type]


@pytest.mark.parametrize("message", ["Deadline Exceeded", "generate: deadline exceeded while waiting for the next item"])
def test_a_call_error_keeps_the_servers_detail_whether_or_not_the_status_line_matches_it(address: str,
                                                                                         message: str) -> None:
    # The second case is the race of a caller's own deadline with the server's named one: the status
    # line and the rich status disagree, and grpcio-status's own reader raises ValueError on it.
    err = _call_error(address, message)
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.details == "Deadline Exceeded"
    assert err.detail is not None
    assert (err.detail.category, err.detail.target) == (DETAIL.category, DETAIL.target)


class EngineGenerateError(Exception):
    """As vLLM raises it: no message of its own, `from` what failed."""


def _raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as caught:   # noqa: BLE001 - with its traceback, as a handler gets it
        return caught


def test_a_traceback_names_files_as_they_are_imported_not_where_the_server_keeps_them() -> None:
    """A caller gets the frames of what failed, each file from its import root (the caller's own
    `json/decoder.py`, `tests/wire/test_errors.py`), through causes too; no absolute path."""
    import json

    from bridge_server.wire.errors import BridgeError

    def decode() -> None:
        try:
            json.loads("{")
        except ValueError as exc:
            raise RuntimeError("could not read it") from exc

    try:
        decode()
    except RuntimeError as caught:
        err = BridgeError.from_exception(caught, "t")
    text = err.traceback
    assert 'File "json/decoder.py"' in text and 'File "tests/wire/test_errors.py"' in text, text
    assert "direct cause" in text and 'File "/' not in text and str(Path.home()) not in text, text


def test_a_wrapper_with_no_message_is_reported_by_what_it_wraps() -> None:
    from bridge_server.wire.errors import BridgeError
    err = BridgeError.from_exception(_raised(EngineGenerateError(), OverflowError("int too big to convert")),
                                     "vllm.AsyncLLMEngine.generate")
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == "vllm.AsyncLLMEngine.generate: EngineGenerateError: OverflowError: int too big to convert"
    assert err.python_type == "EngineGenerateError" and "OverflowError" in err.traceback
    # one with a message of its own keeps it, and its own status
    own = BridgeError.from_exception(_raised(RuntimeError("engine busy"), ValueError("x")), "t")
    assert (own.code, own.message) == (grpc.StatusCode.UNKNOWN, "t: RuntimeError: engine busy")
    # an arithmetic failure comes of the arguments given
    assert BridgeError.from_exception(_raised(ZeroDivisionError("division by zero")), "t").code == \
        grpc.StatusCode.INVALID_ARGUMENT



def test_a_refusal_that_names_its_parameter_is_a_validation_error_naming_it() -> None:
    """vLLM's request checks raise a ValueError that carries the parameter and the value it checked
    (VLLMValidationError); raised alone or wrapped by a wrapper with nothing to say, it is reported
    as a refusal of that parameter, not as a Python error."""
    from vllm.exceptions import VLLMValidationError

    from bridge_server.wire.errors import BridgeError
    refused = VLLMValidationError("Requested sample logprobs of 1024, which is greater than max allowed: 20",
                                  parameter="logprobs", value=1024)
    for exc in (refused, _raised(EngineGenerateError(), refused)):
        err = BridgeError.from_exception(exc, "vllm.AsyncLLMEngine.generate")
        assert (err.code, err.category, err.parameter) == (grpc.StatusCode.INVALID_ARGUMENT, "validation", "logprobs")
        assert err.message == ("vllm.AsyncLLMEngine.generate: parameter logprobs: vLLM refused it: Requested sample "
                               "logprobs of 1024, which is greater than max allowed: 20 (the value it checked: 1024)")
    # a plain ValueError stays a Python error, with its type
    plain = BridgeError.from_exception(ValueError("allowed_token_ids is not None and empty!"), "t")
    assert (plain.category, plain.python_type, plain.parameter) == ("python_error", "ValueError", "")



def test_what_torch_and_imports_say_of_the_arguments_and_the_server_gets_its_status() -> None:
    """torch names a bad size or an allocation past memory only in a RuntimeError's text (UNKNOWN
    before); a module the call needs that is not installed is the server's precondition."""
    from bridge_server.wire.errors import BridgeError
    with pytest.raises(RuntimeError) as negative:
        torch.empty(-1)
    assert BridgeError.from_exception(negative.value, "t").code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(RuntimeError) as huge:
        torch.empty(2**62, dtype=torch.uint8)
    assert BridgeError.from_exception(huge.value, "t").code == grpc.StatusCode.RESOURCE_EXHAUSTED, huge.value
    missing = BridgeError.from_exception(ModuleNotFoundError("No module named 'ray'"), "t")
    assert missing.code == grpc.StatusCode.FAILED_PRECONDITION
    assert BridgeError.from_exception(RuntimeError("engine busy"), "t").code == grpc.StatusCode.UNKNOWN
    # torch's own argument checks, raised for real
    for bad in (lambda: torch.ones(2, 3) @ torch.ones(2, 3), lambda: torch.ones(6).view(4, 4),
                lambda: torch.ones(2) + torch.ones(3), lambda: torch.mm(torch.ones(2, 2), torch.ones(2, 2, 2))):
        with pytest.raises(RuntimeError) as raised:
            bad()
        assert BridgeError.from_exception(raised.value, "t").code == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    with pytest.raises(RuntimeError) as in_python:      # raised by Python code: says nothing of whose fault
        _raise(RuntimeError("engine busy"))
    assert BridgeError.from_exception(in_python.value, "t").code == grpc.StatusCode.UNKNOWN
    with pytest.raises(RuntimeError) as interpreter:    # raised natively, of the server's own state
        seen = {1: 1}
        for key in seen:
            seen[key + 1] = key
    assert BridgeError.from_exception(interpreter.value, "t").code == grpc.StatusCode.UNKNOWN, interpreter.value
    with pytest.raises(NotImplementedError) as no_kernel:      # torch has no kernel for this dtype
        torch.zeros(2, dtype=torch.float8_e4m3fn).cumsum(0)
    assert BridgeError.from_exception(no_kernel.value, "t").code == grpc.StatusCode.INVALID_ARGUMENT, no_kernel.value
    # a process group or a device this worker does not have: its state, not the call's fault
    for said in ("Could not resolve the process group registered under the name g",
                 "invalid argument to exchangeDevice", "Torch not compiled with CUDA enabled"):
        assert BridgeError.from_exception(RuntimeError(said), "t").code == grpc.StatusCode.FAILED_PRECONDITION
    # vLLM's collectives on a group with no device communicator (a CPU group): a ValueError, of the group
    assert BridgeError.from_exception(ValueError("No device communicator found"), "t").code == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert BridgeError.from_exception(ValueError("bad value"), "t").code == grpc.StatusCode.INVALID_ARGUMENT
    # a shared Rust tokenizer busy in another thread: nothing wrong with the call
    assert BridgeError.from_exception(RuntimeError("Already borrowed"), "t").code == grpc.StatusCode.UNAVAILABLE


def _raise(exc: BaseException) -> None:
    raise exc


WIDE = "日本語😀é"    # three and four bytes each in UTF-8, nine and twelve percent-encoded


def _largest(kind: str) -> Any:
    """The largest error each path can raise: every text at its bound, in characters that take the
    most bytes, with a lone surrogate (an OS error's undecodable file name) in the message."""
    from bridge_server.wire.errors import (MAX_FIELD_CHARS, MAX_MESSAGE_CHARS, MAX_TRACEBACK_CHARS, BridgeError,
                                           mux_error_status)
    err = BridgeError(grpc.StatusCode.FAILED_PRECONDITION, WIDE * 100, "\udcff" + WIDE * MAX_MESSAGE_CHARS,
                      target=WIDE * MAX_FIELD_CHARS, parameter=WIDE * MAX_FIELD_CHARS, reason=WIDE * MAX_FIELD_CHARS,
                      python_type=WIDE * MAX_FIELD_CHARS, suggestions=[WIDE * MAX_FIELD_CHARS] * 9,
                      traceback="first frame\n" + WIDE * MAX_TRACEBACK_CHARS + "\nthe failing frame")
    return err.to_status() if kind == "status" else mux_error_status(err.to_mux_error())


def _fail_large(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.abort_with_status(_largest(request.decode()))
    raise AssertionError("abort_with_status returned")


@pytest.mark.parametrize("kind", ["status", "multiplexed"])
def test_the_largest_error_reaches_the_client_whole_every_time(kind: str) -> None:
    """gRPC refuses trailers past 8 KiB at random (RESOURCE_EXHAUSTED "Stream removed"): an error is
    fitted in bytes, not characters, so every one of many calls ends with the server's own status,
    its detail readable, the failing frame kept and the message cut where the note says."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Errors", {"Fail": grpc.unary_unary_rpc_method_handler(_fail_large)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(100):
                with pytest.raises(grpc.RpcError) as caught:
                    channel.unary_unary(METHOD)(kind.encode(), timeout=5)
                err = CallError(caught.value)  # type: ignore[arg-type]
                assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err.details
                assert err.detail is not None and err.detail.message.startswith("\\udcff" + WIDE)
                assert "more characters]" in err.details and err.details == err.detail.message
                assert err.detail.traceback == "" or err.detail.traceback.endswith("the failing frame")
    finally:
        server.stop(None)


def test_an_exceptions_message_shows_no_heap_address() -> None:
    """vLLM quotes objects' default reprs in its errors ("Process group <...ProcessGroup object at
    0x7fb1ec5859f0> is not initialized"): where the heap lies is nothing a client needs."""
    inner = ValueError("Process group <torch.distributed.ProcessGroup object at 0x7fb1ec5859f0> is not initialized")
    for exc in (inner, _raised(RuntimeError(), inner)):
        err = BridgeError.from_exception(exc, "vllm.distributed.in_the_same_node_as")
        assert "0x" not in err.message and "ProcessGroup object> is not initialized" in err.message, err.message



class _Made:
    """What a failed call made: a stand-in for its 2 GB result."""

    err: BaseException | None = None


def test_what_a_failed_call_made_goes_once_its_error_is_told() -> None:
    """A fake matmul refused after it multiplied kept its result for 15 s and more: the frames its
    exception went through held it, in a cycle only a collection finds (the worker's heap is frozen,
    and old objects are collected rarely). Once told, the error keeps its text and lets them go;
    a coroutine that caught an error and goes on is left running."""
    import gc
    import weakref

    refs: list[weakref.ref[_Made]] = []

    def failing() -> None:
        made = _Made()
        refs.append(weakref.ref(made))
        err = ValueError("refused after making something")
        made.err = err            # the cycle: error -> traceback -> frame -> made -> error
        raise err

    async def keeps_going(caught: list[BaseException]) -> str:
        try:
            failing()
        except ValueError as exc:
            caught.append(exc)
        await asyncio.sleep(0)
        return "still running"

    gc.disable()
    try:
        try:
            failing()
        except ValueError as exc:
            assert refs[0]() is not None                  # held by the cycle
            told = BridgeError.from_exception(exc, "f")
        assert refs[0]() is None, "the failed call's frame still holds what it made"
        assert "refused after making something" in told.message and "failing" in told.traceback
        caught: list[BaseException] = []
        coroutine = keeps_going(caught)
        coroutine.send(None)                  # caught, and suspended at its sleep
        BridgeError.from_exception(caught[0], "f")
        with pytest.raises(StopIteration) as done:
            coroutine.send(None)
        assert done.value.value == "still running"
    finally:
        gc.enable()
