"""What a request will cost, counted before vLLM takes it: the logprobs it may produce (made on the
worker's event loop), what it adds to every step of its engine core, and the items of its params the
core holds, a copy per completion. Each is bounded for one request here, and for the live requests
of a shared engine together in `fair_share.py`. (What a request may *say*, its forms, types and
token ids, is `engine_requests.py`'s.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

from adapters.engine_requests import text_of
from bridge_server.wire.errors import BridgeError

__all__ = ["MAX_LOGPROB_ENTRIES", "MAX_REQUEST_ITEMS", "MAX_STEP_US", "check_logprobs", "check_request_items",
           "check_step_cost", "logprob_entries", "prompt_tokens_at_most", "request_items", "step_cost_us"]

# Logprobs one request may ask for in all: n x (max_tokens x (logprobs + 1) + prompt tokens x
# (prompt_logprobs + 1)), vLLM working out each completion's prompt logprobs on its own. vLLM makes and
# detokenizes each on the worker's event loop, and one item may hold them all (a FINAL_ONLY item, or
# DELTA items merged while the stream could not keep up): n=128 with 20 logprobs for 100 tokens held
# the loop 5 s, n=256 with 20 prompt logprobs of 80 words 3.3 s, and every other call of the worker
# waited. Worst case ~12 µs of the loop per entry: at this bound an item holds it ~0.4 s at most; one
# sequence of 1,500 tokens with 20 logprobs each fits. (Requests together: fair_share.py.)
MAX_LOGPROB_ENTRIES = 32_768
# What one request adds to every step of its engine, in the engine core, which steps every request of
# the engine in turn, in microseconds of our CPUs (a GPU's engine core pays more: each write below is a
# kernel launch). vLLM's sampler walks each sequence's bad words in Python at every step, and writes the
# logits of each whose prefix matches, which a one-token word always does: ~3.6 µs a word and sequence,
# a word tokenized with and without its leading space. Its scheduler looks each sequence's last token
# up in its stop_token_ids list, and its logits processors rebuild their tables of every stop token id
# (with min_tokens) and logit_bias entry of every sequence whenever the batch changes. 4,096 one-token
# bad words at n=16 made every step 0.24 s, and a million stop token ids at n=64 0.43 s, for every
# client of the engine, from a 20 KB and a 2 MB request, with health SERVING. Bounded per request, and
# the live requests of a shared engine together (`fair_share.py`).
BAD_WORD_STEP_US = 4.0
TOKEN_ID_STEP_US = 0.03
MAX_STEP_US = 2_000
# The items of a request's sampling params (allowed_token_ids, stop_token_ids, logit_bias, bad words,
# extra_args: every list, set and map item, at any depth), times n: vLLM sends each of a request's n
# completions to the engine core with a copy of its params, which the core keeps as Python objects
# (~35 bytes an item) while it runs, and gives back to its heap, not the system. A 2 MB request of
# 999,000 allowed token ids at n=256 took the core from 4.4 to 10 GB, kept, and held every client's
# requests 33 s, health SERVING. Bounded per request, and the live requests of a shared engine
# together (`fair_share.py`).
MAX_REQUEST_ITEMS = 2_000_000


def prompt_tokens_at_most(prompt: Any, max_model_len: int) -> int:
    """How many tokens a prompt can come to, before it is tokenized: its ids, else its text's UTF-8
    bytes (no tokenizer makes more tokens than bytes, but for a few special ones), within the model."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, Mapping) else None
    if isinstance(ids, (list, tuple)):
        return min(len(ids), max_model_len)
    text = text_of(prompt)
    if text is not None:
        return min(len(text.encode("utf-8", "surrogatepass")) + 8, max_model_len)
    return max_model_len


def logprob_entries(params: Any, prompt_tokens: int, vocab: int, max_model_len: int) -> int:
    """The logprobs a request may produce in all (see MAX_LOGPROB_ENTRIES); 0 without any."""
    k, pk = getattr(params, "logprobs", None), getattr(params, "prompt_logprobs", None)
    n = _completions(params)
    entries = 0
    if type(k) is int:
        tokens = getattr(params, "max_tokens", None)
        tokens = tokens if type(tokens) is int and 0 < tokens < max_model_len else max_model_len
        entries += tokens * ((vocab if k < 0 else k) + 1)
    if type(pk) is int:
        entries += prompt_tokens * ((vocab if pk < 0 else pk) + 1)
    return n * entries


def _completions(params: Any) -> int:
    """A request's n, as vLLM fans it out (a value it would refuse counts as one)."""
    n = getattr(params, "n", 1)
    return n if type(n) is int and n > 0 else 1


def _step_parts(params: Any) -> tuple[int, dict[str, int]]:
    """A SamplingParams' sequences (n), and its bad words, stop token ids and logit_bias entries."""
    if type(params).__name__ != "SamplingParams":
        return 1, {}
    return _completions(params), {field: len(getattr(params, field, None) or ())
                                  for field in ("bad_words", "stop_token_ids", "logit_bias")}


def step_cost_us(params: Any) -> float:
    """What a request adds to every step of its engine core (see MAX_STEP_US); 0 for most."""
    n, counts = _step_parts(params)
    return n * sum(count * _STEP_US[field] for field, count in counts.items())


_STEP_US = {"bad_words": BAD_WORD_STEP_US, "stop_token_ids": TOKEN_ID_STEP_US, "logit_bias": TOKEN_ID_STEP_US}


def request_items(params: Any, cap: int = MAX_REQUEST_ITEMS) -> int:
    """The items of a SamplingParams' containers, at any depth, times its n (see MAX_REQUEST_ITEMS);
    counting stops a little past `cap`."""
    fields = getattr(type(params), "__struct_fields__", None)
    if type(params).__name__ != "SamplingParams" or not fields:
        return 0
    n = _completions(params)
    each = 0
    stack = [getattr(params, f, None) for f in fields]
    while stack and each * n <= cap:
        value = stack.pop()
        if isinstance(value, str):
            each += len(value) // _CHARS_PER_ITEM
        elif isinstance(value, dict):
            each += len(value)
            stack.extend(v for v in (*value.keys(), *value.values()) if isinstance(v, _HELD))
        elif isinstance(value, (list, tuple, set, frozenset)):
            each += len(value)
            stack.extend(v for v in value if isinstance(v, _HELD))
    return each * n


_HELD = (str, list, tuple, set, frozenset, dict)
_CHARS_PER_ITEM = 32      # text counts by its size: an item costs the core about 35 bytes


def check_request_items(label: str, name: str, params: Any, items: int) -> None:
    if items <= MAX_REQUEST_ITEMS:
        return
    n = _completions(params)
    sizes = {f: len(v) for f in _ITEM_FIELDS if isinstance(v := getattr(params, f, None), (list, tuple, set, dict))}
    field = max(sizes, key=sizes.__getitem__) if sizes else ""
    where = f"{name}.{field}" if field else name
    raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                      f"{label}: parameter {where}: n ({n}) x the items of the request's lists and maps "
                      f"({', '.join(f'{f} {c:,}' for f, c in sizes.items() if c)}) comes to at least {items:,} items "
                      f"that the engine core holds, a copy for each completion, over this server's limit of "
                      f"{MAX_REQUEST_ITEMS:,} for one request: ask for fewer completions, or fewer items",
                      target=label, parameter=where, reason="too many items")


_ITEM_FIELDS = ("allowed_token_ids", "stop_token_ids", "logit_bias", "bad_words", "stop", "extra_args")


def check_step_cost(label: str, name: str, params: Any, cost: float) -> None:
    if cost <= MAX_STEP_US:
        return
    n, counts = _step_parts(params)
    field = max(counts, key=lambda f: counts[f] * _STEP_US[f])
    parts = " + ".join(f"{count:,} {each.replace('_', ' ')} x {_STEP_US[each]:g} µs"
                       for each, count in counts.items() if count)
    raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                      f"{label}: parameter {name}.{field}: n ({n}) x ({parts}) comes to {cost:,.0f} µs that the "
                      f"engine core would add to every step, for every request of the engine, over this server's "
                      f"limit of {MAX_STEP_US:,} µs for one request: ask for fewer completions, bad words, stop "
                      f"token ids or logit biases", target=label, parameter=f"{name}.{field}",
                      reason="too costly per step")


def check_logprobs(label: str, name: str, params: Any, entries: int) -> None:
    if entries > MAX_LOGPROB_ENTRIES:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"{label}: parameter {name}: n ({getattr(params, 'n', 1)}) x (max_tokens x (logprobs + 1) "
                          f"+ prompt tokens x (prompt_logprobs + 1)) comes to {entries:,} logprobs, over this "
                          f"server's limit of {MAX_LOGPROB_ENTRIES:,} for one request: ask for fewer completions, "
                          f"tokens or logprobs", target=label, parameter=f"{name}.logprobs", reason="too many logprobs")
