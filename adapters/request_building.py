"""Building a request to an `AsyncLLM` engine before vLLM sees it, where that is more than handing
vLLM the prompt: a long prompt, bad words or structured outputs cost tokenizer work that would hold
the worker's event loop, so such requests are built on the engine's own threads, in turns (hosts,
then their callers); a truncated text is encoded without changing the shared tokenizer; a new
grammar is tried first; and what vLLM refuses only once it has the tokens (a prompt too long for the
model, a `min_tokens` that cannot follow it) is refused by the parameter it is about. The adapter
(`async_llm.py`) runs `prepared` from its `generate`, `encode` and `add_request`, once its request
guard has set `asker`.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import os
import traceback
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from adapters import grammar_check, grammar_ends, tokenizer_calls
from adapters.engine_life import PREFIX
from adapters.engine_requests import LONG_PROMPT_CHARS, check_grammar_backend, text_of
from adapters.request_costs import prompt_tokens_at_most
from adapters.spec import Policy
from bridge_server.wire.errors import BridgeError, clip
from bridge_server.wire.turns import Turns

__all__ = ["asker", "prepared"]


@dataclasses.dataclass(slots=True)
class _TokenizeLanes:
    """An engine's threads for building requests off the loop, each taken in turns (hosts, then
    their callers). `build` builds every client's structured, `bad_words` and long requests; the
    whole-text encoding of a long truncated text (seconds for a million characters, however few
    tokens it keeps) runs on `long`, in the process's turn for long encodings
    (`tokenizer_calls.cpu_turn`), so a client's queue of them holds no other client's `build`."""

    build: ThreadPoolExecutor
    build_turns: Turns
    long: ThreadPoolExecutor
    long_turns: Turns


_tokenizing: weakref.WeakKeyDictionary[Any, _TokenizeLanes] = weakref.WeakKeyDictionary()


def _lanes(engine: Any) -> _TokenizeLanes:
    lanes = _tokenizing.get(engine)
    if lanes is None:
        lanes = _tokenizing[engine] = _TokenizeLanes(
            ThreadPoolExecutor(1, thread_name_prefix="bridge-tokenize"), Turns(0.0),
            ThreadPoolExecutor(1, thread_name_prefix="bridge-tokenize-long"), Turns(0.0))
    return lanes


async def _in_turn(pool: ThreadPoolExecutor, turns: Turns, client: str, work: Any) -> Any:
    await turns.acquire(client)
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, work)
    finally:
        turns.release()
# Whose request the call is and how long a new grammar's trial may take, as the guard found them
# (`grammar_check.py` takes hosts and clients in turn): the guard and the call run in one context.
asker: contextvars.ContextVar[tuple[str, float]] = contextvars.ContextVar(
    "asker", default=("", Policy.grammar_compile_s))


async def prepared(engine: Any, prompt: Any, params: Any, request_id: str, kwargs: dict[str, Any],
                    method: str) -> Any:
    """The prompt to hand to vLLM: as given, or, where building the request costs tokenizer work
    (a long prompt, bad words, structured outputs) or would change the shared tokenizer (a text
    prompt truncated: `tokenizer_calls.py`), the request vLLM builds from it, built off the event
    loop (`_TokenizeLanes`), from the prompt's token ids where it is truncated; and a new
    grammar tried first where its trial can be stopped (`grammar_check.py`), and watched in the
    engine (`grammar_ends.py`)."""
    text = text_of(prompt)
    truncated = _truncated_to(engine, prompt, params)
    if not (truncated is not None or text is not None and len(text) > LONG_PROMPT_CHARS
            or getattr(params, "bad_words", None) or getattr(params, "structured_outputs", None) is not None
            or _may_not_fit(engine, prompt, text) or _may_outlast(engine, prompt, params)):
        return prompt
    from vllm.entrypoints.utils import _validate_truncation_size

    tokenization = dict(kwargs.get("tokenization_kwargs") or {})
    try:
        _validate_truncation_size(engine.model_config.max_model_len, params.truncate_prompt_tokens, tokenization)
    except ValueError as exc:
        where, label = f"{_PARAMS_NAME[method]}.truncate_prompt_tokens", f"{PREFIX}.{method}"
        raise BridgeError.validation(f"{label}: parameter {where}: vLLM refused it: {clip(str(exc), 400)}",
                                     target=label, parameter=where) from None
    lanes = _lanes(engine)
    client, compile_s = asker.get()
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None

    def encoded(text: str, keep: int) -> dict[str, Any]:
        """The truncated text's prompt: its token ids, as the whole text's encoding truncated."""
        with tokenizer_calls.cpu_turn(client, text):
            ids = tokenizer_calls.encode_unchanged(engine.tokenizer, text, tokenization.get("add_special_tokens", True),
                                                   keep)
        return {"prompt_token_ids": ids, **({"cache_salt": salt} if salt is not None else {})}
    ready = None
    if truncated is not None and text is not None and len(text) >= tokenizer_calls.LONG_TEXT_CHARS:
        ready = await _in_turn(lanes.long, lanes.long_turns, client, functools.partial(encoded, text, truncated))

    def build() -> Any:
        given = (ready if ready is not None else encoded(text, truncated) if truncated is not None and text is not None
                 else prompt)
        return engine.input_processor.process_inputs(
            request_id, given, params, kwargs.get("arrival_time"), kwargs.get("lora_request"), tokenization,
            kwargs.get("trace_headers"), kwargs.get("priority", 0), kwargs.get("data_parallel_rank"))
    # The threads are the engine's, every client's: hosts (then their callers) take turns at them, or
    # one stranger's queue of long requests held every other client's structured ones for a minute.
    try:
        request = await _in_turn(lanes.build, lanes.build_turns, client, build)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        _refuse_named(f"{PREFIX}.{method}", _PARAMS_NAME[method], exc)
        raise
    _check_room(f"{PREFIX}.{method}", _PARAMS_NAME[method], int(engine.model_config.max_model_len), request)
    check_grammar_backend(f"{PREFIX}.{method}", request)
    key = await grammar_check.check(engine, f"{PREFIX}.{method}", request, client, compile_s)
    if key is not None:
        grammar_ends.watch(engine, key, client, request)
    return request


_PARAMS_NAME = {"generate": "sampling_params", "encode": "pooling_params", "add_request": "params"}


def _may_not_fit(engine: Any, prompt: Any, text: str | None) -> bool:
    """Whether the engine may refuse the prompt for its length: vLLM does so with a bare ValueError
    that names no parameter, so such a prompt is built here (`_refuse_named`). A text shorter than a
    quarter of max_model_len in characters always fits (a token is at least a UTF-8 byte, but for a
    few special ones), so a short prompt costs one comparison."""
    max_len = int(engine.model_config.max_model_len)
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, Mapping) else None
    if isinstance(ids, (list, tuple)):
        return len(ids) >= max_len
    if text is None or 4 * len(text) + 8 < max_len:
        return False
    return prompt_tokens_at_most(prompt, max_len) >= max_len


def _may_outlast(engine: Any, prompt: Any, params: Any) -> bool:
    """Whether the params' `min_tokens` may not fit after the prompt within max_model_len (then the
    request is built, and `_check_room` judges it). A plain request (no min_tokens) costs one read."""
    least = getattr(params, "min_tokens", 0)
    if type(least) is not int or least <= 0:
        return False
    max_len = int(engine.model_config.max_model_len)
    if isinstance(prompt, Mapping) and prompt.get("multi_modal_data"):
        return True         # placeholders add tokens the text does not show
    return least + prompt_tokens_at_most(prompt, max_len) > max_len


def _check_room(label: str, params_name: str, max_len: int, request: Any) -> None:
    """Refuses a request whose `min_tokens` cannot follow its prompt within max_model_len: vLLM
    stops none of its sequences before min_tokens, not even at the model's length, and schedules no
    token past that length, so such a request never ends. It keeps its seats in the engine's batch
    and its KV blocks for as long as its caller waits (16 of them held every seat of an engine: every
    other client's request waited, while health said SERVING)."""
    params = getattr(request, "sampling_params", None)
    least = getattr(params, "min_tokens", 0)
    if not least:
        return
    ids, embeds = getattr(request, "prompt_token_ids", None), getattr(request, "prompt_embeds", None)
    prompt_len = len(ids) if ids is not None else len(embeds) if embeds is not None else 0
    room = max_len - prompt_len
    if least > room:
        where = f"{params_name}.min_tokens"
        raise BridgeError.validation(
            f"{label}: parameter {where}: {least:,} tokens cannot follow this prompt's {prompt_len:,} within the "
            f"engine's max_model_len of {max_len:,} (at most {max(room, 0):,} can): vLLM ends no sequence before "
            f"min_tokens and generates none past max_model_len, so the request would never end",
            target=label, parameter=where)


def _refuse_named(label: str, params_name: str, exc: BaseException) -> None:
    """What vLLM's checks raise while building a request, refused by the parameter's name, not passed
    on as a bare Python error. Its prompt checks (too long for the model, empty, an id out of the
    vocabulary) are about `prompt`. Its structured-output checks are about the params' structured
    output: a grammar, regex or schema they refuse (a ValueError, or the JSONDecodeError of a schema
    that is not JSON), or one whose parts they index unchecked (on `auto`, guidance's checks read a
    structural tag or schema that xgrammar refused: a KeyError or TypeError)."""
    if getattr(exc, "parameter", None):
        return       # vLLM named the parameter itself (`errors.py` reports it)
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, ValueError) and frames and frames[-1].name.startswith("_validate_model_input"):
        raise BridgeError.validation(f"{label}: parameter prompt: vLLM refused it: {clip(str(exc), 400)}",
                                     target=label, parameter="prompt") from exc
    if any(f"{os.sep}structured_output{os.sep}" in f.filename or "structured_output" in f.name for f in frames):
        where = f"{params_name}.structured_outputs"
        verb = "refused" if isinstance(exc, ValueError) else "could not read"
        raise BridgeError.validation(f"{label}: parameter {where}: vLLM {verb} it: {type(exc).__name__}: "
                                     f"{clip(str(exc), 400)}", target=label, parameter=where) from exc


def _truncated_to(engine: Any, prompt: Any, params: Any) -> int | None:
    """The tokens a text prompt is truncated to (its params' `truncate_prompt_tokens`; vLLM drops any
    other truncation a client asks for), where the worker tokenizes it itself, leaving the shared
    tokenizer's settings as they are; None: no truncation, or one vLLM makes on token ids (a prompt of
    token ids, a multimodal one, a model whose prompts vLLM prepares otherwise)."""
    limit = getattr(params, "truncate_prompt_tokens", None)
    config = engine.model_config
    if type(limit) is not int or text_of(prompt) is None or getattr(engine, "tokenizer", None) is None or \
            isinstance(prompt, Mapping) and prompt.get("multi_modal_data") or config.is_encoder_decoder or \
            (config.encoder_config or {}).get("do_lower_case", False):
        return None
    return int(config.max_model_len) if limit <= -1 else limit
