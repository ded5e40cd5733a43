"""What a client's call does with an engine's tokenizer, which every request of the engine shares.

A Hugging Face fast tokenizer keeps its truncation and padding settings in the Rust tokenizer it
wraps, and a call that asks for other settings changes them there, then the next call changes them
back. Meanwhile another thread may be using it: vLLM detokenizes every stream's tokens on the event
loop, the worker tokenizes long prompts in a thread of its own, and a client's `encode` runs in the
worker's shared lane. The Rust side then refuses one of them ("Already borrowed"): 105 of a
bystander's requests failed in 37 s while a stranger looped `encode("hi", padding="max_length")`,
and one `max_length` of 10**8 padded to 12.9 GB. So no call changes the shared tokenizer: text is
encoded as it is set (with no truncation or padding), and a truncation is made on the encoding
itself, as the tokenizer would have made it (tested against the library's own, side and special
tokens included); padding is not offered.

Encoding a long text is CPU work outside the interpreter's lock: a dozen of them at once took both
of a machine's cores from the engine, and every client's tokens came ten times slower. So a long
text (LONG_TEXT_CHARS or more) is encoded by one thread at a time in the process, hosts (then
their callers) taking turns (`cpu_turn`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from adapters.spec import calling_client
from bridge_server.wire.errors import BridgeError, clip, quote
from bridge_server.wire.turns import Round, join_round, next_in_round

__all__ = ["LONG_TEXT_CHARS", "cpu_turn", "decode", "encode", "encode_unchanged"]

LONG_TEXT_CHARS = 16_384     # a text this long is encoded in its turn (`cpu_turn`)

ENCODE_LABEL = "PreTrainedTokenizerBase.encode"
MAX_LENGTH = 2**31 - 1       # what the tokenizer's Rust side takes as a length
DECODE_LABEL = "PreTrainedTokenizerBase.decode"


def _backend(tokenizer: Any) -> Any:
    """The Rust tokenizer of a fast tokenizer whose encoding is the library's plain one; else None."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(tokenizer, PreTrainedTokenizerFast) and isinstance(backend, Tokenizer) and \
            getattr(type(tokenizer), "_batch_encode_plus", None) is PreTrainedTokenizerFast._batch_encode_plus:
        return backend
    return None


def encode_unchanged(tokenizer: Any, text: str, add_special_tokens: bool = True,
                     max_length: int | None = None) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=..., truncation=max_length is not None,
    max_length=...)`, ids alike, without changing the tokenizer's settings. The encoding is done
    outside the interpreter's lock (batch encoding releases it)."""
    backend = _backend(tokenizer)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        # A slow tokenizer keeps no such state; settings from the model's own files are the library's
        # to keep or change: its own call.
        if max_length is None:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, truncation=True,
                                     max_length=max_length))
    if max_length is None:
        return list(backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
    encoding = backend.encode_batch([text], add_special_tokens=False)[0]
    room = max_length - (backend.num_special_tokens_to_add(False) if add_special_tokens else 0)
    encoding.truncate(max(room, 0), stride=0, direction=getattr(tokenizer, "truncation_side", "right"))
    if add_special_tokens:
        encoding = backend.post_process(encoding, None, True)
    return list(encoding.ids)


class _CpuTurns:
    """One long encoding at a time in the process, hosts (then their callers) in turn, each waiting
    in its own thread (the caller's: the shared lane's, within the caller's share of it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = False
        self._waiting: Round[threading.Event] = {}

    @contextlib.contextmanager
    def turn(self, caller: str) -> Iterator[None]:
        with self._lock:
            if not self._busy and not self._waiting:
                self._busy = True
                mine = None
            else:
                mine = threading.Event()
                join_round(self._waiting, caller, mine)
        if mine is not None:
            mine.wait()
        try:
            yield
        finally:
            self._next()

    def _next(self) -> None:
        with self._lock:
            if not self._waiting:
                self._busy = False
                return
            next_in_round(self._waiting).set()


_cpu_turns = _CpuTurns()


def cpu_turn(caller: str, text: str) -> contextlib.AbstractContextManager[None]:
    """The caller's turn to encode `text`, where it is long; at once where it is not."""
    return _cpu_turns.turn(caller) if len(text) >= LONG_TEXT_CHARS else contextlib.nullcontext()


def _refuse(parameter: str, why: str) -> BridgeError:
    return BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation", f"{ENCODE_LABEL}: parameter {parameter}: {why}",
                       target=ENCODE_LABEL, parameter=parameter, reason="not allowed")


def encode(tokenizer: Any, text: Any, text_pair: Any = None, add_special_tokens: bool = True, padding: Any = False,
           truncation: Any = None, max_length: Any = None, stride: int = 0, padding_side: Any = None,
           return_tensors: Any = None, **kwargs: Any) -> list[int]:
    """A tokenizer's `encode` as a client may call it: text, whether to add special tokens, and a
    truncation to at most `max_length` tokens. What would change the shared tokenizer or make more
    than the text's own tokens (padding, strides, tensors, pairs, pre-split words) is refused by name."""
    for name, value, default in (("text_pair", text_pair, None), ("padding", padding, False),
                                 ("stride", stride, 0), ("padding_side", padding_side, None),
                                 ("return_tensors", return_tensors, None)):
        if value is not default and value != default:
            raise _refuse(name, f"not an option this server passes on (it takes text, add_special_tokens, "
                                f"truncation and max_length); got {quote(value, 40)}")
    if kwargs:
        raise _refuse(quote(next(iter(kwargs)), 40), "not an option this server passes on (it takes text, "
                                                     "add_special_tokens, truncation and max_length)")
    if type(text) is not str:
        raise BridgeError.validation(f"{ENCODE_LABEL}: parameter text: expected a string (the library's signature "
                                     f"also names lists of words and of ids, which this server does not pass on), "
                                     f"got {type(text).__name__}", target=ENCODE_LABEL, parameter="text")
    if type(add_special_tokens) is not bool:
        raise BridgeError.validation(f"{ENCODE_LABEL}: parameter add_special_tokens: expected a bool, got "
                                     f"{type(add_special_tokens).__name__}", target=ENCODE_LABEL,
                                     parameter="add_special_tokens")
    if truncation is not None and type(truncation) is not bool:
        raise _refuse("truncation", f"expected a bool or nil (a truncation to max_length tokens), got "
                                    f"{quote(truncation, 40)}")
    if max_length is not None and (type(max_length) is not int or not 1 <= max_length <= MAX_LENGTH):
        shown = clip(str(max_length), 40) if type(max_length) is int else quote(max_length, 40)
        raise BridgeError.validation(f"{ENCODE_LABEL}: parameter max_length: expected an int from 1 to "
                                     f"{MAX_LENGTH:,}, got {shown}", target=ENCODE_LABEL, parameter="max_length")
    # As the library: a max_length truncates unless truncation is False.
    limit = max_length if truncation is not False else None
    if truncation is True and max_length is None:
        limit = getattr(tokenizer, "model_max_length", None)
        limit = limit if type(limit) is int and 0 < limit < 1 << 31 else None
    with cpu_turn(calling_client.get(), text):
        return encode_unchanged(tokenizer, text, add_special_tokens, limit)


def decode(tokenizer: Any, token_ids: Any, skip_special_tokens: bool = False,
           clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
    """A tokenizer's `decode`, each id checked against the vocabulary, and the decoding itself done
    outside the interpreter's lock. The library's `decode` holds the lock throughout (0.13 s without a
    break for a million ids on the tiny model, over a second on a real vocabulary), and every other
    call of the worker, its streams included, waits meanwhile. Its batch decoding releases the lock and
    gives the same text; the clean-up is `decode`'s own. Anything but a fast tokenizer's plain decode
    of a list of ids is `decode` itself."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    if kwargs:      # the library passes them on to its own `_decode`, which ignores what it does not know
        name = quote(next(iter(kwargs)), 40)
        raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                          f"{DECODE_LABEL}: parameter {name}: not an option this server passes on (it takes "
                          f"token_ids, skip_special_tokens and clean_up_tokenization_spaces)", target=DECODE_LABEL,
                          parameter=name, reason="not allowed")
    for name, flag in (("skip_special_tokens", skip_special_tokens),
                       ("clean_up_tokenization_spaces", clean_up_tokenization_spaces)):
        if type(flag) is not bool and (flag is not None or name == "skip_special_tokens"):
            raise BridgeError.validation(f"{DECODE_LABEL}: parameter {name}: expected a bool, got "
                                         f"{type(flag).__name__}", target=DECODE_LABEL, parameter=name)
    if hasattr(token_ids, "tolist") and hasattr(token_ids, "shape"):    # a tensor or an array: its ids
        if len(token_ids.shape) > 1:
            raise BridgeError.validation(f"{DECODE_LABEL}: parameter token_ids: expected one sequence of token ids, "
                                         f"got a {len(token_ids.shape)}-dimensional tensor", target=DECODE_LABEL,
                                         parameter="token_ids")
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, (int, list, tuple)) or isinstance(token_ids, bool):
        raise BridgeError.validation(f"{DECODE_LABEL}: parameter token_ids: expected a token id or a list of them, "
                                     f"got {type(token_ids).__name__}", target=DECODE_LABEL, parameter="token_ids")
    ids = [token_ids] if type(token_ids) is int else token_ids
    size = len(tokenizer)
    if isinstance(ids, (list, tuple)) and ids and not (set(map(type, ids)) == {int} and 0 <= min(ids)
                                                       and max(ids) < size):     # in C; then which one
        i, token = next((i, t) for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < size)
        shown = clip(str(token), 40) if type(token) is int else type(token).__name__
        raise BridgeError.validation(f"{DECODE_LABEL}: parameter token_ids[{i}]: expected a token id from 0 "
                                     f"to {size - 1:,} (the tokenizer's vocabulary), got {shown}",
                                     target=DECODE_LABEL, parameter=f"token_ids[{i}]")
    backend = getattr(tokenizer, "_tokenizer", None)
    if (type(token_ids) is not list or not isinstance(backend, Tokenizer)
            or getattr(type(tokenizer), "_decode", None) is not PreTrainedTokenizerFast._decode):
        return str(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=clean_up_tokenization_spaces))
    text: str = backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
    clean = tokenizer.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
        else clean_up_tokenization_spaces
    return str(tokenizer.clean_up_tokenization(text)) if clean else text
