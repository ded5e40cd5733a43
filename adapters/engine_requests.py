"""What a request to an `AsyncLLM` engine must pass before vLLM sees it.

vLLM checks a request's arguments for its own users, who run it in their own process: a value it
lets through may still kill the engine core (a token id outside the model's vocabulary, in a prompt
or in sampling params, indexes past the logits or the embedding), block the worker's event loop
(completions by the million), or cost far more than its size (a schema nested hundreds deep). Here
the engine is every client's, so each such value is refused at once, by name, before it reaches
vLLM. The adapter (`async_llm.py`) runs these from its request guards and its SamplingParams rule.
"""

from __future__ import annotations

import functools
import json
import sys
import weakref
from collections.abc import Mapping
from typing import Any

import grpc
import msgspec

from adapters.spec import Policy
from bridge_server.wire.errors import BridgeError, clip, quote

__all__ = ["I64_MAX", "I64_MIN", "LONG_PROMPT_CHARS", "MAX_BAD_WORDS", "MAX_N", "MAX_SCHEMA_DEPTH",
           "MAX_STOP_STRINGS", "MAX_WORDS_CHARS", "check_prompt", "check_prompt_form", "check_request_options",
           "check_sampling_params", "check_token_ids", "clip_int", "pooling_rule", "sampling_rule", "text_of"]

LONG_PROMPT_CHARS = 16_384      # longer prompts are tokenized off the event loop
_token_chars: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def text_of(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
        return str(prompt["prompt"])
    return None


def _max_token_chars(engine: Any) -> int | None:
    """The most characters one token of the engine's vocabulary stands for (None: no tokenizer).
    A prompt longer than max_model_len times this cannot fit, whatever it says."""
    if engine in _token_chars:
        return _token_chars[engine]
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        return None
    try:
        longest = max(len(t) for t in tokenizer.get_vocab())
    except Exception:
        return None
    _token_chars[engine] = longest
    return longest


def check_prompt(engine: Any, label: str, prompt: Any, params: Any, tokenization: Mapping[str, Any] | None,
                 policy: Policy) -> None:
    """A prompt over the operator's limit, or one that cannot fit the model whatever it says, is
    refused here, at once, before anything tokenizes it."""
    text = text_of(prompt)
    if text is None:
        return
    if len(text) > policy.max_prompt_chars:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"{label}: parameter prompt: {len(text):,} characters is over this server's limit of "
                          f"{policy.max_prompt_chars:,} (max_prompt_chars)", target=label, parameter="prompt",
                          reason="max_prompt_chars")
    if len(text) <= LONG_PROMPT_CHARS // 8:
        return
    # (vLLM drops any truncation tokenization_kwargs ask for: a text that cannot fit was tokenized
    # whole, 2-3 s for a million characters, and then refused by a bare ValueError naming nothing)
    truncating = getattr(params, "truncate_prompt_tokens", None) is not None
    max_len = engine.model_config.max_model_len
    per_token = _max_token_chars(engine)
    if not truncating and per_token is not None and len(text) > max_len * per_token:
        raise BridgeError.validation(
            f"{label}: parameter prompt: a prompt of {len(text):,} characters cannot fit this engine's "
            f"max_model_len of {max_len:,} tokens (each token stands for at most {per_token} characters); "
            f"shorten it, or ask for truncation (truncate_prompt_tokens)", target=label, parameter="prompt")


# The keys of vLLM's prompt forms (TextPrompt, TokensPrompt, EmbedsPrompt: one prompt;
# ExplicitEncoderDecoderPrompt: two), and those that need a multimodal model.
_SINGLE_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "token_type_ids", "prompt_embeds", "cache_salt",
                                 "multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"})
_PAIR_PROMPT_KEYS = frozenset({"encoder_prompt", "decoder_prompt", "mm_processor_kwargs"})
_MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


def check_prompt_form(engine: Any, label: str, prompt: Any, where: str = "prompt") -> None:
    """A prompt map is one of vLLM's prompt forms, and one this engine's model takes. vLLM ignored a
    key of none of them, and refused the rest deep in its input processing as bare ValueErrors that
    named no parameter ("The decoder prompt cannot be empty", "... is not a multimodal model",
    "Cannot pass encoder-decoder prompt to decoder-only models")."""
    config = engine.model_config
    if getattr(config, "skip_tokenizer_init", False) and text_of(prompt) is not None and not (
            isinstance(prompt, Mapping) and prompt.get("prompt_token_ids") is not None):
        raise BridgeError.validation(f"{label}: parameter {where}: text, but this engine was made without a "
                                     f"tokenizer (skip_tokenizer_init): send token ids, "
                                     f"{{'prompt_token_ids': [...]}}", target=label, parameter=where)
    if not isinstance(prompt, Mapping):
        return
    pair = "encoder_prompt" in prompt or "decoder_prompt" in prompt
    keys = _PAIR_PROMPT_KEYS if pair else _SINGLE_PROMPT_KEYS
    unknown = next((k for k in prompt if k not in keys), None)
    if unknown is not None:
        form = "an encoder-decoder prompt" if pair else "a prompt"
        raise BridgeError.validation(f"{label}: parameter {where}[{quote(unknown, 40)}]: not a key of {form} (its "
                                     f"keys: {', '.join(sorted(keys))})", target=label,
                                     parameter=f"{where}[{clip(str(unknown), 40)}]")
    if pair and not getattr(config, "is_encoder_decoder", False):
        raise BridgeError.validation(f"{label}: parameter {where}: an encoder-decoder prompt (encoder_prompt, "
                                     f"decoder_prompt), but this engine's model is decoder-only: send one prompt",
                                     target=label, parameter=where)
    if pair:
        for key in ("encoder_prompt", "decoder_prompt"):
            check_prompt_form(engine, label, prompt.get(key), f"{where}.{key}")
        return
    given = next((k for k in _MULTIMODAL_KEYS if prompt.get(k) is not None), None)
    if given is not None and not getattr(config, "is_multimodal_model", False):
        raise BridgeError.validation(f"{label}: parameter {where}.{given}: this engine's model is not multimodal "
                                     f"and takes text or token ids only", target=label, parameter=f"{where}.{given}")
    if "prompt_embeds" in prompt and not getattr(config, "enable_prompt_embeds", False):   # vLLM: even of None
        raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                          f"{label}: parameter {where}.prompt_embeds: this engine takes no prompt embeddings "
                          f"(engine arg enable_prompt_embeds)", target=label, parameter=f"{where}.prompt_embeds",
                          reason="prompt embeds disabled")
    salt = prompt.get("cache_salt")
    if isinstance(salt, str) and len(salt) > MAX_CACHE_SALT_CHARS:
        raise BridgeError.validation(f"{label}: parameter {where}.cache_salt: expected at most "
                                     f"{MAX_CACHE_SALT_CHARS:,} characters (vLLM copies the salt into each of the "
                                     f"request's completions), got {len(salt):,} characters", target=label,
                                     parameter=f"{where}.cache_salt")
    ids = prompt.get("prompt_token_ids")
    if isinstance(ids, (list, tuple)) and not ids and prompt.get("prompt_embeds") is None:
        raise BridgeError.validation(f"{label}: parameter {where}.prompt_token_ids: expected at least one token id, "
                                     f"got an empty list", target=label, parameter=f"{where}.prompt_token_ids")


def check_request_options(engine: Any, label: str, args: Mapping[str, Any]) -> None:
    """The options vLLM refused only once the request was being built, without naming them: a data
    parallel rank outside the engine's, a LoRA adapter for an engine without LoRA (a state of the
    engine, not of the call), and a prompt_text, which vLLM takes only with a request it built itself."""
    rank = args.get("data_parallel_rank")
    size = engine.vllm_config.parallel_config.data_parallel_size
    if type(rank) is int and not 0 <= rank < size:
        raise BridgeError.validation(f"{label}: parameter data_parallel_rank: expected a rank of this engine's "
                                     f"{size} data parallel rank(s) (0 to {size - 1}), got {clip_int(rank)}",
                                     target=label, parameter="data_parallel_rank")
    if args.get("lora_request") is not None and not engine.vllm_config.lora_config:
        raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                          f"{label}: parameter lora_request: this engine runs without LoRA (engine arg "
                          f"enable_lora), so it takes no LoRA request", target=label, parameter="lora_request",
                          reason="lora disabled")
    prompt = args.get("prompt")
    if args.get("prompt_text") is not None and type(prompt).__name__ != "EngineCoreRequest":
        raise BridgeError.validation(f"{label}: parameter prompt_text: vLLM takes it only with a prompt that is a "
                                     f"request it built (EngineCoreRequest); the text of this prompt is the prompt",
                                     target=label, parameter="prompt_text")
    request_id = args.get("request_id")
    if isinstance(request_id, str) and len(request_id) > MAX_REQUEST_ID_CHARS:
        raise BridgeError.validation(f"{label}: parameter request_id: {len(request_id):,} characters, over this "
                                     f"server's limit of {MAX_REQUEST_ID_CHARS:,} (vLLM copies the id into each of "
                                     f"the request's completions, its outputs and its engine core messages)",
                                     target=label, parameter="request_id")
    headers = args.get("trace_headers")
    if isinstance(headers, Mapping):
        size = sum(len(str(k)) + len(str(v)) for k, v in headers.items())
        if len(headers) > MAX_TRACE_HEADERS or size > MAX_TRACE_HEADER_CHARS:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"{label}: parameter trace_headers: {len(headers):,} headers of {size:,} characters in "
                              f"all, over this server's limit of {MAX_TRACE_HEADERS} headers and "
                              f"{MAX_TRACE_HEADER_CHARS:,} characters (vLLM sends them to the engine core with each "
                              f"completion)", target=label, parameter="trace_headers", reason="too large")


# A request's trace headers (W3C trace context: a few short headers), which vLLM copies to the engine
# core with each of its n completions, tracing or not: 16 headers of a million characters at n=16 took
# the core to 3.7 GB and the worker +1.3 GB.
MAX_TRACE_HEADERS = 64
MAX_TRACE_HEADER_CHARS = 8_192
# A request's id, which vLLM copies into each of its n child requests' ids and every output and engine
# core message about them: one id of 999,000 characters at n=256 took the worker +900 MB and the core
# +650 MB, kept, and a bystander's 4-token generation took 3 s. A UUID is 36 characters.
MAX_REQUEST_ID_CHARS = 1_024
# A prompt's cache salt, which vLLM copies into each of its n child requests as well: salts of 999,000
# characters, four requests at n=256 a round, left the published engine's core 0.7-0.9 GB larger each
# round, kept. A salt that keeps prompts apart needs a few dozen characters.
MAX_CACHE_SALT_CHARS = 1_024


# What a client may pass to the tokenizer with its prompt (`tokenization_kwargs`), and of what type.
# vLLM hands the map to the tokenizer as keyword arguments: `padding="max_length"` with a `max_length`
# of a billion made a billion-token list (10 million: 1.3 s; a billion: gigabytes) in the process that
# serves every client, before the prompt's length was checked; other keys made the tokenizer fail
# with messages that name nothing (`return_tensors`, a str `add_special_tokens`).
TOKENIZATION_KWARGS = {"truncation": bool, "max_length": int, "add_special_tokens": bool}


def check_tokenization(engine: Any, label: str, kwargs: Any) -> None:
    if not kwargs:
        return
    if not isinstance(kwargs, Mapping):
        raise BridgeError.validation(f"{label}: parameter tokenization_kwargs: expected a map, got "
                                     f"{type(kwargs).__name__}", target=label, parameter="tokenization_kwargs")
    allowed = ", ".join(TOKENIZATION_KWARGS)
    for key, value in kwargs.items():
        where = f"tokenization_kwargs[{quote(key)}]"
        kind = TOKENIZATION_KWARGS.get(key) if isinstance(key, str) else None
        if kind is None:
            raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation",
                              f"{label}: parameter {where}: not a tokenizer option this server passes on "
                              f"(it takes {allowed})", target=label, parameter=where, reason="not allowed")
        if type(value) is not kind:
            raise BridgeError.validation(f"{label}: parameter {where}: expected {kind.__name__}, got "
                                         f"{type(value).__name__} {quote(value, 40)}", target=label, parameter=where)
    bound = engine.model_config.max_model_len
    length = kwargs.get("max_length")
    if length is not None and not 1 <= length <= bound:
        raise BridgeError.validation(f"{label}: parameter tokenization_kwargs['max_length']: expected 1 to this "
                                     f"engine's max_model_len ({bound:,}), got {clip_int(length)}", target=label,
                                     parameter="tokenization_kwargs['max_length']")


def check_token_ids(engine: Any, label: str, prompt: Any, where: str = "prompt") -> None:
    """Token ids in a prompt are indexes into the model's embedding: one outside it kills the engine
    core (IndexError in its forward pass), and with it every request of every client. vLLM checks
    only the largest id against the larger of the tokenizer's and the model's vocabulary, and never
    a negative one. So each id must be an int from 0 to the model's vocabulary size - 1 (for a
    multimodal model, whose placeholders may lie past it, vLLM's own bound)."""
    if not isinstance(prompt, Mapping):
        return
    for key in ("encoder_prompt", "decoder_prompt"):
        if key in prompt:
            check_token_ids(engine, label, prompt[key], f"{where}.{key}")
    ids = prompt.get("prompt_token_ids")
    if ids is None:
        return
    name = f"{where}.prompt_token_ids"
    if not isinstance(ids, (list, tuple)) or set(map(type, ids)) - {int}:
        bad = next((x for x in ids if type(x) is not int), ids) if isinstance(ids, (list, tuple)) else ids
        raise BridgeError.validation(f"{label}: parameter {name}: expected a list of ints (token ids), got "
                                     f"{'an item of type ' if bad is not ids else ''}{type(bad).__name__}",
                                     target=label, parameter=name)
    if not ids:
        return
    config = engine.model_config
    bound = config.get_vocab_size()
    tokenizer = getattr(engine, "tokenizer", None)
    if getattr(config, "is_multimodal_model", False) and tokenizer is not None:
        bound = max(bound, getattr(tokenizer, "max_token_id", bound - 1) + 1)
    _within_vocabulary(label, name, ids, bound)


def _within_vocabulary(label: str, name: str, ids: Any, bound: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= bound):
        i, bad = next((i, x) for i, x in enumerate(ids) if not 0 <= x < bound)
        raise BridgeError.validation(f"{label}: parameter {name}[{i}]: token id {bad} is outside this model's "
                                     f"vocabulary (0 to {bound - 1})", target=label, parameter=f"{name}[{i}]")


def _json_shape(value: Any) -> tuple[int, int, int]:
    """How deeply a JSON document (or its text) nests, how many properties its objects declare in
    all, and the most one declares: counted without recursion (text nested past Python's own limit
    counts as too deep)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            return sys.maxsize, 0, 0
        except ValueError:
            return 0, 0, 0       # not JSON: vLLM says so
    depth, total, most, level = 0, 0, 0, [(value, 1)]
    while level:
        x, d = level.pop()
        if isinstance(x, (dict, list)) and d > depth:
            depth = d
        if isinstance(x, dict):
            declared = x.get("properties")
            if isinstance(declared, dict):
                total += len(declared)
                most = max(most, len(declared))
            level.extend((v, d + 1) for v in x.values())
        elif isinstance(x, list):
            level.extend((v, d + 1) for v in x)
    return depth, total, most


def _chars(value: Any) -> int:
    """A structured output field's size: a string's characters, a schema's as JSON text, a choice
    list's in all."""
    if value is None or isinstance(value, bool):
        return 0
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return sum(map(len, value)) + len(value)
    try:
        return len(json.dumps(value, default=str))
    except (TypeError, ValueError, RecursionError):
        return 0     # not JSON: the checks below, or vLLM, say so


def _check_structured_outputs(label: str, name: str, params: Any) -> None:
    """A JSON schema's conversion to a grammar (xgrammar's, in vLLM's input checks on the thread that
    prepares every client's structured requests, and again in the engine core) cannot be stopped once
    started, and its time grows with the cube of how deeply the schema nests (200 nested objects:
    1.6 s; 400: 14 s) and with the square of an object's optional properties (1,000: 0.6 s; 4,000:
    9.5 s). Real schemas nest a few levels and declare tens of properties; within the bounds here a
    schema takes well under a second."""
    so = getattr(params, "structured_outputs", None)
    if so is None:
        return
    size = sum(_chars(getattr(so, field, None)) for field in STRUCTURED_FIELDS)
    if size > MAX_STRUCTURED_CHARS:
        where = f"{name}.structured_outputs"
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"{label}: parameter {where}: its schema, grammar, regex, choices and tags hold {size:,} "
                          f"characters in all, over this server's limit of {MAX_STRUCTURED_CHARS:,} (compiling "
                          f"them holds up every structured request of the engine, and what the engine core "
                          f"compiled it keeps)", target=label, parameter=where, reason="schema too large")
    for field in ("json", "structural_tag"):
        value = getattr(so, field, None)
        if value is None:
            continue
        depth, total, most = _json_shape(value)
        where = f"{name}.structured_outputs.{field}"
        if depth > MAX_SCHEMA_DEPTH:
            shown = "deeper than Python's JSON parser goes" if depth == sys.maxsize else f"{depth} levels deep"
            why = f"it nests {shown}, over this server's limit of {MAX_SCHEMA_DEPTH} levels (a schema's cost " \
                  f"grows with the cube of its depth)"
        elif most > MAX_SCHEMA_OBJECT_PROPERTIES or total > MAX_SCHEMA_PROPERTIES:
            why = f"it declares {total:,} properties, {most:,} in one object, over this server's limits of " \
                  f"{MAX_SCHEMA_PROPERTIES:,} in all and {MAX_SCHEMA_OBJECT_PROPERTIES} in one object (a " \
                  f"schema's cost grows with the square of an object's properties)"
        else:
            continue
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation", f"{label}: parameter {where}: {why}",
                          target=label, parameter=where, reason="schema too large")
    _check_structural_tag(label, f"{name}.structured_outputs.structural_tag", getattr(so, "structural_tag", None))


def _check_structural_tag(label: str, where: str, tag: Any) -> None:
    """vLLM reads a structural tag in one of two shapes: `{"structures": [{"begin", "schema",
    "end"}...], "triggers": [...]}` (the older), or one with a `format` that xgrammar reads. On the
    `auto` backend a tag xgrammar refuses is read again by guidance's checks, which index its parts
    unchecked, so a tag of neither shape came back as a bare KeyError ('triggers'). Its shape is
    checked here, by name; what is inside a `format` is xgrammar's to judge."""
    if not isinstance(tag, str):
        return       # vLLM's own type check names it
    try:
        value = json.loads(tag)
    except (ValueError, RecursionError):
        raise BridgeError.validation(f"{label}: parameter {where}: expected a JSON object as text, got "
                                     f"{quote(tag, 60)}, which is not JSON", target=label, parameter=where) from None
    if not isinstance(value, dict):
        raise BridgeError.validation(f"{label}: parameter {where}: expected a JSON object, got a JSON "
                                     f"{type(value).__name__}", target=label, parameter=where)
    if "structures" not in value:
        if "format" not in value:
            raise BridgeError.validation(
                f"{label}: parameter {where}: expected an object with a 'format' (or with 'structures' and "
                f"'triggers'), got one with keys {quote(sorted(map(str, value)), 80)}", target=label, parameter=where)
        return
    structures, triggers = value["structures"], value.get("triggers")
    if not isinstance(structures, list):
        raise BridgeError.validation(f"{label}: parameter {where}['structures']: expected a list, got "
                                     f"{type(structures).__name__}", target=label, parameter=where)
    for i, item in enumerate(structures):
        missing = [k for k in ("begin", "schema", "end") if not isinstance(item, dict) or k not in item]
        bad = [k for k in ("begin", "end") if not missing and not isinstance(item[k], str)]
        if missing or bad:
            why = f"without {', '.join(missing)}" if missing else f"whose {', '.join(bad)} is not text"
            got = "an object " + why if isinstance(item, dict) else f"a JSON {type(item).__name__}"
            raise BridgeError.validation(f"{label}: parameter {where}['structures'][{i}]: expected an object with "
                                         f"text 'begin' and 'end' and a 'schema', got {got}",
                                         target=label, parameter=where)
    if not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
        got = "none" if triggers is None else quote(triggers, 60)
        raise BridgeError.validation(f"{label}: parameter {where}['triggers']: expected a list of text, got {got}",
                                     target=label, parameter=where)


def check_engine_types(label: str, name: str, value: Any) -> None:
    """A request's structs (its params, its LoRA request) as vLLM's engine core will decode them:
    sent through vLLM's own msgpack encoder and decoded, strictly typed, by its own decoder. A field
    the core's decoder refuses kills the core's input thread, and every request after it hangs while
    the worker still looks alive; the binding's checks refuse what they know of, and this refuses
    the rest, whatever field or type it is, for ~2 us a request."""
    if not isinstance(value, msgspec.Struct):
        return
    try:
        _engine_decoder(type(value)).decode(_engine_encoder().encode(value))
    except msgspec.ValidationError as exc:       # "Expected `int`, got `bool` - at `$.output_kind`"
        text = str(exc)
        at = _field_path(type(value), text.partition(" - at `$")[2].rstrip("`"))
        where = f"{name}.{at}" if at else name
        raise BridgeError.validation(f"{label}: parameter {where}: {text.partition(' - at ')[0]} (vLLM's engine core "
                                     f"decodes {type(value).__name__} strictly)", target=label,
                                     parameter=where) from None
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError) as exc:
        raise BridgeError.validation(f"{label}: parameter {name}: cannot be sent to vLLM's engine core: "
                                     f"{type(exc).__name__}: {str(exc)[:200]}", target=label, parameter=name) from None


def _field_path(cls: type, at: str) -> str:
    """msgspec's path into a struct (`.seed`; `[1]` for a struct sent as an array) by field names."""
    fields = getattr(cls, "__struct_fields__", ())
    if at.startswith("[") and "]" in at:
        index, _, rest = at[1:].partition("]")
        if index.isdigit() and int(index) < len(fields):
            at = f".{fields[int(index)]}{rest}"
    return at.lstrip(".")


@functools.lru_cache(maxsize=1)
def _engine_encoder() -> Any:
    from vllm.v1.serial_utils import MsgpackEncoder
    return MsgpackEncoder()


@functools.lru_cache(maxsize=16)
def _engine_decoder(cls: type) -> Any:
    from vllm.v1.serial_utils import MsgpackDecoder
    return MsgpackDecoder(cls)


def check_grammar_backend(label: str, request: Any) -> None:
    """With structured outputs on `auto` (vLLM's default), vLLM picks a backend per request: xgrammar,
    or, for what xgrammar cannot take (a choice holding a newline, a regex with lookahead or a
    backreference, `patternProperties`), guidance or outlines. But its engine core compiles every
    request with the one backend it started with, xgrammar, and a request it cannot compile kills
    the core (every stream of the engine fails, ~12 s until it is rebuilt). So on `auto` a request
    runs only where xgrammar takes it; an engine made with another backend takes what that one does."""
    so = getattr(getattr(request, "sampling_params", None), "structured_outputs", None)
    chosen = getattr(so, "_backend", None)
    if so is None or not getattr(so, "_backend_was_auto", False) or chosen in (None, "xgrammar"):
        return
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
    try:
        validate_xgrammar_grammar(request.sampling_params)
        why = ""
    except ValueError as exc:
        why = f" ({str(exc)[:200]})"
    raise BridgeError.validation(
        f"{label}: parameter sampling_params.structured_outputs: xgrammar, the structured-output backend this "
        f"engine's core runs (structured_outputs_config backend 'auto'), cannot take it{why}; vLLM would hand this "
        f"request alone to {chosen}, which that core cannot run (it dies). An engine made with backend "
        f"{chosen!r} takes it", target=label, parameter="sampling_params.structured_outputs")


def check_sampling_params(engine: Any, label: str, name: str, params: Any) -> None:
    """What vLLM lets through of sampling (and pooling) params and then pays for. Token ids index the
    logits in the engine core: a stop token id past the vocabulary, with `min_tokens`, kills it (vLLM
    checks stop ids not at all, and `allowed_token_ids` only against the tokenizer's length), so each
    token id field must hold ids from 0 to the model's vocabulary size - 1. And a structured output's
    schema is bounded in depth and in properties."""
    check_engine_types(label, name, params)
    if type(params).__name__ == "PoolingParams":
        bound = engine.model_config.get_vocab_size()
        ids = getattr(params, "returned_token_ids", None)
        if ids:
            _within_vocabulary(label, f"{name}.returned_token_ids", list(ids), bound)
        step = getattr(params, "step_tag_id", None)
        if type(step) is int:
            _within_vocabulary(label, f"{name}.step_tag_id", [step], bound)
        return
    if type(params).__name__ != "SamplingParams":
        return
    _check_structured_outputs(label, name, params)
    _check_bad_words(engine, label, name, params)
    allowed = getattr(params, "allowed_token_ids", None)
    if allowed is not None and not allowed:      # vLLM's own says only "allowed_token_ids is not None and empty!"
        raise BridgeError.validation(f"{label}: parameter {name}.allowed_token_ids: expected at least one token id "
                                     f"(or None, for all), got an empty list, which would allow no token",
                                     target=label, parameter=f"{name}.allowed_token_ids")
    bound = engine.model_config.get_vocab_size()
    _check_logprob_counts(engine, label, name, params, bound)
    for field in ("stop_token_ids", "allowed_token_ids"):
        ids = getattr(params, field, None)
        if ids:
            _within_vocabulary(label, f"{name}.{field}", list(ids), bound)
    bias = getattr(params, "logit_bias", None)
    if bias:
        _within_vocabulary(label, f"{name}.logit_bias", list(bias), bound)


def _check_logprob_counts(engine: Any, label: str, name: str, params: Any, vocab: int) -> None:
    """vLLM's own check of logprobs against the engine's max_logprobs reads -1 as the vocabulary's
    size and reports that number, by the field's name alone ("Requested sample logprobs of 1024"
    for a request that asked for -1). The same rule, said of what the client sent."""
    most = getattr(engine.model_config, "max_logprobs", -1)
    most = vocab if most == -1 else most
    for field in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, field, None)
        if type(asked) is not int or not asked:
            continue
        count = vocab if asked == -1 else asked
        if count > most:
            meaning = f"-1, every token of the vocabulary ({vocab:,})" if asked == -1 else f"{asked:,}"
            raise BridgeError.validation(f"{label}: parameter {name}.{field}: {meaning} is more than this engine "
                                         f"returns per token (max_logprobs {most:,})", target=label,
                                         parameter=f"{name}.{field}")


def _check_bad_words(engine: Any, label: str, name: str, params: Any) -> None:
    """vLLM turns each bad word into tokens as the engine's tokenizer encodes it without its leading
    whitespace, and indexes the first: a word the tokenizer makes no token of failed the request as a
    bare IndexError. Whitespace alone is refused before (`sampling_rule`); this asks the tokenizer,
    for what else it may drop (once per word, where vLLM encodes each twice; their number and
    characters are bounded by MAX_BAD_WORDS and MAX_WORDS_CHARS)."""
    words = getattr(params, "bad_words", None)
    tokenizer = getattr(engine, "tokenizer", None)
    if not words or tokenizer is None:
        return          # without a tokenizer vLLM makes no tokens of them either
    for i, word in enumerate(words):
        if isinstance(word, str) and not tokenizer.encode(text=word.lstrip(), add_special_tokens=False):
            raise BridgeError.validation(f"{label}: parameter {name}.bad_words[{i}]: expected a word, got "
                                         f"{quote(word)}, of which this engine's tokenizer makes no token",
                                         target=label, parameter=f"{name}.bad_words[{i}]")


# The most stop strings and bad words one request may carry: vLLM tokenizes each bad word before the
# request starts, and looks for each stop string after every token, in the process that serves every
# other request too (the OpenAI API allows 4 stop strings).
MAX_STOP_STRINGS = 256
MAX_BAD_WORDS = 4096
# ... and their characters in all: the one thread that tokenizes an engine's bad words, for every
# client, spent 16 s on 16 words of a million characters, and every request with bad words, a
# structured output or a long prompt waited behind it; stop strings are searched after every token.
MAX_WORDS_CHARS = 131_072
# How deeply a structured output's JSON schema may nest (JSON levels: an object property is two).
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_PROPERTIES = 1024          # properties a schema's objects declare in all
MAX_SCHEMA_OBJECT_PROPERTIES = 256    # ... and one object
# The characters of a structured output's schema, grammar, regex, choices and tags in all: a schema
# whose enum held 100,000 strings (10 MB) took 37 s to compile, every other structured request of the
# engine waiting behind it, and grew the engine core by 2.9 GB, kept for good; 3 MB, 8-15 s.
MAX_STRUCTURED_CHARS = 131_072
STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "structural_tag", "whitespace_pattern")
# Completions of one prompt (SamplingParams.n). vLLM fans a request out into n requests on the event
# loop, ~50 us each, with no bound: n=1,000,000 blocks a worker's loop for about a minute.
MAX_N = 256
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def clip_int(value: int) -> str:
    text = str(value) if value.bit_length() < 200 else f"an int of {value.bit_length():,} bits"
    return text[:80]


def sampling_rule(fields: Mapping[str, Any], policy: Policy) -> None:
    label = "vllm.SamplingParams"
    if fields.get("logits_processors"):
        raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                          f"{label}: field logits_processors: not settable by a client (it names code to run)",
                          target=label, parameter="logits_processors", reason="not allowed")
    for key, limit in (("stop", MAX_STOP_STRINGS), ("bad_words", MAX_BAD_WORDS)):
        value = fields.get(key)
        if isinstance(value, (list, tuple)) and len(value) > limit:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"{label}: field {key}: {len(value):,} strings is over this server's limit of {limit:,}",
                              target=label, parameter=key, reason=f"too many {key}")
        if isinstance(value, (str, list, tuple)):
            chars = len(value) if isinstance(value, str) else sum(len(w) for w in value if isinstance(w, str))
            if chars > MAX_WORDS_CHARS:
                raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                                  f"{label}: field {key}: {chars:,} characters in all is over this server's limit of "
                                  f"{MAX_WORDS_CHARS:,}", target=label, parameter=key, reason=f"{key} too long")
    words = fields.get("bad_words")
    if isinstance(words, (list, tuple)):
        # vLLM tokenizes each word with its leading whitespace stripped and indexes its first token: a
        # word of whitespace only (or none) failed as a bare IndexError (see `_check_bad_words`)
        blank = next((i for i, w in enumerate(words) if isinstance(w, str) and not w.lstrip()), None)
        if blank is not None:
            got = "an empty string" if not words[blank] else f"whitespace only ({quote(words[blank])})"
            raise BridgeError.validation(f"{label}: field bad_words[{blank}]: expected a word, got {got}",
                                         target=label, parameter=f"bad_words[{blank}]")
    n = fields.get("n")
    if type(n) is int and n > MAX_N:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"{label}: field n: {clip_int(n)} completions of one prompt is over this server's limit "
                          f"of {MAX_N}", target=label, parameter="n", reason="too many completions")
    _sendable(label, fields, "extra_args")


def pooling_rule(fields: Mapping[str, Any], policy: Policy) -> None:
    _sendable("vllm.PoolingParams", fields, "extra_kwargs")


_PLAIN = (type(None), bool, int, float, str, bytes, list, tuple, dict)
_CONTAINERS = frozenset({list, tuple, dict, set, frozenset})
_INT_ONLY = {int}


def _sendable(label: str, fields: Mapping[str, Any], free_field: str) -> None:
    """vLLM sends a request's params to its engine core as msgpack after registering the request in
    the worker, and a value msgpack cannot carry fails it only then: the request's state stays in
    the worker for good, and the error names nothing. msgpack has no ints past 64 bits, anywhere in
    a field, and the one field typed `Any` (options for the engine's own plug-ins) takes plain data
    only, not a client's ref to some object. Every value is looked at (the decoder bounds how many
    a request holds); a list of ints only, the usual big one, in C."""
    for key, value in fields.items():
        if type(value) not in _CONTAINERS and key != free_field:     # the usual field: one int check
            if type(value) is int and not I64_MIN <= value <= I64_MAX:
                raise BridgeError.validation(f"{label}: field {key}: {clip_int(value)} does not fit in 64 bits",
                                             target=label, parameter=key)
            continue
        todo: list[tuple[Any, str]] = [(value, key)]
        while todo:
            x, where = todo.pop()
            if type(x) is int and not I64_MIN <= x <= I64_MAX:
                raise BridgeError.validation(f"{label}: field {where}: {clip_int(x)} does not fit in 64 bits",
                                             target=label, parameter=where)
            if key == free_field and type(x) not in _PLAIN:
                raise BridgeError.validation(f"{label}: field {where}: expected plain data (None, bool, int, float, "
                                             f"str, bytes, lists and maps of them), got {type(x).__name__}",
                                             target=label, parameter=where)
            if isinstance(x, dict):
                todo.extend((k, f"{where} key") for k in x)
                todo.extend((v, f"{where}[{k!r:.40}]") for k, v in x.items())
            elif isinstance(x, (list, tuple, set, frozenset)):
                if x and set(map(type, x)) == _INT_ONLY:
                    if min(x) < I64_MIN or max(x) > I64_MAX:
                        i, bad = next((i, v) for i, v in enumerate(x) if not I64_MIN <= v <= I64_MAX)
                        raise BridgeError.validation(f"{label}: field {where}[{i}]: {clip_int(bad)} does not fit in "
                                                     f"64 bits", target=label, parameter=f"{where}[{i}]")
                    continue
                todo.extend((v, f"{where}[{i}]") for i, v in enumerate(x))
