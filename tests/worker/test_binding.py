"""Argument checks (`bridge_server/worker/binding.py`), in process against the real catalog: every
parameter and record field that vLLM annotates (or the documents type) gets a strict check, and the
checks refuse what vLLM would only refuse later, in another thread or process."""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from vllm.sampling_params import RequestOutputKind

from bridge_server.wire.errors import BridgeError
from bridge_server.worker.binding import (
    Building,
    Checks,
    _bind_plainly,
    _class_hints,
    _class_signature,
    _documented,
    _field_check,
    _keyword_shape,
    _resolve,
    bind_arguments,
    member_checks,
    namespace_of,
)
from bridge_server.worker.catalog import Catalog, Entry, Kind
from bridge_server.worker.server import default_catalog


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return default_catalog()


def checks_of(e: Entry) -> Checks:
    documented = {p.name: p.type for p in e.doc.params} if e.doc else {}
    if e.kind is Kind.METHOD:
        return member_checks(e.owner, e.attr, tuple(documented.items()))
    fn = e.override or (e.owner if e.kind is Kind.CONSTRUCTOR else e.resolve())
    return Checks(namespace_of(fn), documented)


def callables(catalog: Catalog) -> Iterator[tuple[Entry, inspect.Parameter]]:
    for e in catalog.entries.values():
        if e.kind not in (Kind.MODULE_ATTR, Kind.ATTRIBUTE) and e.signature is not None:
            yield from ((e, p) for p in e.signature.parameters.values())


def test_a_function_documented_in_two_places_is_guarded_alike_in_both(catalog: Catalog) -> None:
    """vLLM's `init_logger` is in both documented modules: its bounds guarded one of them, and the other
    took a name of a million characters (250 GB of placeholder loggers, kept for good). Every entry
    that calls the same Python function runs the same guard and override."""
    by_callable: dict[int, list[Any]] = {}
    for entry in catalog.entries.values():
        if entry.kind.name in ("FUNCTION", "CLASSMETHOD"):
            by_callable.setdefault(id(entry.resolve()), []).append(entry)
    shared = [entries for entries in by_callable.values() if len(entries) > 1]
    assert any(e.name.endswith("init_logger") for entries in shared for e in entries), shared
    for entries in shared:
        assert len({(e.guard, e.override) for e in entries}) == 1, [(e.name, e.guard, e.override) for e in entries]


def test_every_typed_parameter_of_the_catalog_is_checked(catalog: Catalog) -> None:
    """A check that fails to build would silently let anything through: none may."""
    checked, unchecked = 0, []
    for e, p in callables(catalog):
        checks = checks_of(e)
        annotation = _resolve(p.annotation, checks.namespace)
        if annotation is None and _documented(checks.documented.get(p.name.lower(), "")) is None:
            continue       # neither vLLM nor the documents say what it takes
        if checks._make(p) is None:
            unchecked.append(f"{e.name}({p.name}: {p.annotation})")
        else:
            checked += 1
    assert not unchecked, unchecked
    assert checked > 300, checked


def test_every_field_of_every_record_class_a_map_can_build_is_checked(catalog: Catalog) -> None:
    unchecked = [f"{cls.__name__}.{name}: {hint}" for cls in catalog.types.values()
                 for name, hint in _class_hints(cls).items()
                 if hint is not Any and not name.startswith("_") and _field_check(cls, name) is None]
    assert not unchecked, unchecked


def test_the_quick_key_check_of_a_map_agrees_with_binding_it(catalog: Catalog) -> None:
    """A map whose keys the precomputed shape accepts is never bound (it is what most of a request's
    checks cost); the shape must accept exactly what binding would, for every class a map can build:
    each field alone, all of them, all the required ones, and each with an unknown key or one left out."""
    import random
    rng = random.Random(7)
    compared = 0
    for cls in catalog.types.values():
        shape = _keyword_shape(cls)
        if shape is None:
            continue
        accepted, required = shape
        names = sorted(accepted)
        cases = [set(required), set(names), {"no_such_field", *required}]
        cases += [{n, *required} for n in names]
        cases += [set(required) - {n} for n in required]
        cases += [set(rng.sample(names, rng.randint(0, len(names)))) | set(required) for _ in range(10)]
        for keys in cases:
            try:
                _class_signature(cls).bind(**dict.fromkeys(keys))
                binds = True
            except TypeError:
                binds = False
            assert (keys <= accepted and required <= keys) == binds, (cls, sorted(keys))
            compared += 1
    assert compared > 400, compared


def bind(catalog: Catalog, name: str, *args: Any, **kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    entry = catalog.entries[name]
    assert entry.signature is not None
    return bind_arguments(name, entry.signature, list(args), kwargs, Building(catalog.short_types, catalog.rule),
                          checks_of(entry))


REFUSED = [
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"max_tokens": 3.0}, "r"), {}, "sampling_params.max_tokens",
     "expected int | None, got float 3.0"),
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"n": True}, "r"), {}, "sampling_params.n", "got bool True"),
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"top_p": math.inf}, "r"), {}, "sampling_params.top_p",
     "expected a finite number, got inf"),
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"output_kind": 7}, "r"), {}, "sampling_params.output_kind",
     "expected vllm.sampling_params.RequestOutputKind, got int 7"),
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"output_kind": True}, "r"), {}, "sampling_params.output_kind",
     "got bool True"),     # equal to 1 (DELTA), but msgspec, and so vLLM's engine core, refuses it (and dies)
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"output_kind": "DELTA"}, "r"), {}, "sampling_params.output_kind",
     "got str 'DELTA'"),
    # what the class itself refuses is what is said, an enum given by value alongside or not
    # (and the parameter is the field it names)
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"temperature": 0.0, "n": 2, "output_kind": 1}, "r"), {},
     "sampling_params.n", "n must be 1 when using greedy sampling, got 2"),
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"top_p": 0.0, "output_kind": 0}, "r"), {}, "sampling_params.top_p",
     "top_p must be in (0, 1], got 0.0"),
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"max_tokens": 0}, "r"), {}, "sampling_params.max_tokens",
     "max_tokens must be at least 1, got 0"),
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"top_k": -5}, "r"), {}, "sampling_params.top_k",
     "top_k must be 0 (disable), or at least 1, got -5"),
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"structured_outputs": {"json": 3}}, "r"), {},
     "sampling_params.structured_outputs.json", "expected str | dict | None, got int 3"),
    ("vllm.AsyncLLMEngine.generate", ("Hi", {}, 7), {}, "request_id", "expected str, got int 7"),
    ("vllm.AsyncLLMEngine.generate", ({"prompt": 3}, {}, "r"), {}, "prompt", "at TextPrompt.prompt"),
    ("vllm.AsyncLLMEngine.generate", ({"prompt_token_ids": [1, 2], "cache_salt": 5}, {}, "r"), {}, "prompt",
     "at TokensPrompt.cache_salt: Input should be a valid string"),      # not TextPrompt's missing `prompt`
    ("vllm.AsyncLLMEngine.generate", ("Hi", {}, "r"), {"lora_request": {"lora_name": "a", "lora_int_id": 1.0,
                                                                       "lora_path": "/x"}},
     "lora_request.lora_int_id", "expected int, got float 1.0"),
    # vLLM's own refusal of an id below 1 ("id must be > 0") names no field
    ("vllm.AsyncLLMEngine.generate", ("Hi", {}, "r"), {"lora_request": {"lora_name": "a", "lora_int_id": 0,
                                                                       "lora_path": "/x"}},
     "lora_request.lora_int_id", "expected an adapter's id, an integer from 1 to 2**63 - 1, got 0"),
    ("vllm.AsyncLLMEngine.encode", ("Hi", {"task": "no-such-task"}, "r"), {}, "pooling_params.task",
     "got str 'no-such-task'"),
    ("vllm.AsyncLLMEngine.abort", ("r", 1), {}, "internal", "expected bool, got int 1"),
    # `params: SamplingParams | PoolingParams`: a map is built as the first, and the message says how to
    # send the other
    ("vllm.AsyncLLMEngine.add_request", ("r", "Hi", {"task": "embed"}), {}, "params.task",
     "(a map given for params is built as SamplingParams; for PoolingParams, send a Record of its type"),
    ("vllm.distributed.get_pp_indices", (32.0, 0, 2), {}, "num_hidden_layers", "expected int, got float 32.0"),
    ("vllm.distributed.tensor_model_parallel_all_reduce", ([1.0, 2.0],), {}, "input_",
     "expected torch.Tensor, got list"),
    ("vllm.distributed.graph_capture", ("no-such-device",), {}, "device", "which names none"),
    ("vllm.config.ParallelConfig", (), {"data_parallel_size": "2"}, "data_parallel_size", "got str '2'"),
    ("vllm.AsyncEngineArgs", (), {"model": "/m", "max_num_seqs": 2.5}, "max_num_seqs", "got float 2.5"),
]


def _signatures(catalog: Catalog) -> Iterator[inspect.Signature]:
    def f(a: int, b: int = 2, /, c: int = 3, *, d: int, e: int = 5) -> None: ...
    def g(a: int, /, b: int) -> None: ...
    yield from (inspect.signature(f), inspect.signature(g))
    for e in catalog.entries.values():
        if e.signature is not None:
            yield e.signature


def test_the_quick_bind_binds_as_python_does_or_leaves_it_to_python(catalog: Catalog) -> None:
    """A request's arguments are bound without `Signature.bind` where they plainly fit (no *args or
    **kwargs, each name known once, every required one given); wherever it binds, the arguments and
    their order, and what the callee gets by position and by name, are what Python's bind gives, and
    whatever Python would refuse it leaves to Python (which names the problem)."""
    import itertools
    import random
    rng = random.Random(11)
    quick = 0
    for sig in _signatures(catalog):
        names = list(sig.parameters)
        pool = names + ["no_such_parameter"]
        counts = sorted({0, 1, 2, 3, len(names) - 1, len(names), len(names) + 1} - {-1})
        singles = rng.sample(pool, min(len(pool), 12))
        cases = [(n, set(kw)) for n in counts for kw in itertools.chain([()], ((k,) for k in singles))]
        cases += [(rng.choice(counts), set(rng.sample(pool, rng.randint(0, len(pool))))) for _ in range(30)]
        required = [p.name for p in sig.parameters.values() if p.default is p.empty]
        cases += [(0, set(required)), (0, set(required) | set(singles[:2]))]
        for n, keys in cases:
            args, kwargs = list(range(n)), {k: k for k in keys}
            try:
                expected = sig.bind(*args, **kwargs)
            except TypeError:
                expected = None
            got = _bind_plainly(sig, args, kwargs)
            if got is None:
                continue
            quick += 1
            assert expected is not None, (sig, n, keys)
            assert list(got.arguments.items()) == list(expected.arguments.items()), (sig, n, keys)
            assert (got.args, got.kwargs) == (expected.args, expected.kwargs), (sig, n, keys)
    assert quick > 100     # it does bind: most of the catalog's calls take no *args or **kwargs


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: f"{c[0].rpartition('.')[2]}:{c[3]}")
def test_a_value_vllm_would_refuse_later_is_refused_now(catalog: Catalog,
                                                        case: tuple[str, tuple[Any, ...], dict[str, Any], str, str]) -> None:
    name, args, kwargs, parameter, expected = case
    with pytest.raises(BridgeError) as err:
        bind(catalog, name, *args, **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.parameter == parameter and expected in err.value.message, err.value.message
    assert err.value.message.startswith(name)


PRIVATE = [   # a record's or a callee's own bookkeeping, by each way a client can name it
    ("vllm.AsyncLLMEngine.generate", ("Hi", {"_bad_words_token_ids": [[5000]]}, "r"), {},
     "sampling_params._bad_words_token_ids"),
    ("vllm.AsyncEngineArgs", (), {"model": "/m", "_api_process_count": 4}, "_api_process_count"),
    ("vllm.config.ParallelConfig", (), {"_data_parallel_master_port_list": [1]}, "_data_parallel_master_port_list"),
    ("vllm.SamplingParams", (), {"_all_stop_token_ids": {5000}}, "_all_stop_token_ids"),
    ("vllm.SamplingParams", (), {"max_tokens": 2, "_bad_words_token_ids": [[]]}, "_bad_words_token_ids"),
]


@pytest.mark.parametrize("case", PRIVATE, ids=lambda c: f"{c[0].rpartition('.')[2]}:{c[3]}")
def test_no_client_sets_a_private_field_or_argument(catalog: Catalog,
                                                    case: tuple[str, tuple[Any, ...], dict[str, Any], str]) -> None:
    """SamplingParams derives `_bad_words_token_ids` and `_all_stop_token_ids` from its public fields,
    checked, and the engine core trusts them: given directly, an id past the vocabulary killed it."""
    name, args, kwargs, parameter = case
    with pytest.raises(BridgeError) as err:
        bind(catalog, name, *args, **kwargs)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and err.value.parameter == parameter, err.value
    assert "is private" in err.value.message and err.value.message.startswith(name), err.value.message


def test_values_vllm_takes_are_passed_on_as_given(catalog: Catalog) -> None:
    args, kwargs = bind(catalog, "vllm.AsyncLLMEngine.generate", {"prompt_token_ids": [1, 2, 3]},
                        {"max_tokens": 3, "output_kind": 1, "stop": ["x"], "structured_outputs": {"json": {}}},
                        "r", priority=2)
    params = args[1]
    assert type(params).__name__ == "SamplingParams" and params.max_tokens == 3
    assert params.output_kind is RequestOutputKind.DELTA      # by value, passed on as the member vLLM compares with
    assert type(params.structured_outputs).__name__ == "StructuredOutputsParams"
    assert args[0] == {"prompt_token_ids": [1, 2, 3]} and kwargs == {"priority": 2}
    (device,), _ = bind(catalog, "vllm.distributed.graph_capture", "cpu")
    assert device == torch.device("cpu")           # a device by name: the wire has no device kind
    t = torch.ones(2)
    (same,), _ = bind(catalog, "vllm.distributed.tensor_model_parallel_all_reduce", t)
    assert same is t


def test_a_struct_the_engine_core_would_refuse_is_refused_whatever_its_field() -> None:
    """The last check before vLLM's engine core: its own strict decoding, done in the worker. Built
    here without the binding (as a constructor's ref or another path could hand one over)."""
    from vllm import PoolingParams, SamplingParams
    from vllm.lora.request import LoRARequest

    from adapters.engine_requests import check_engine_types
    cases = [(SamplingParams(max_tokens=3, output_kind=True), "sampling_params.output_kind", "got `bool`"),
             (SamplingParams(max_tokens=3, seed=True), "sampling_params.seed", "got `bool`"),
             (SamplingParams(max_tokens=3, skip_special_tokens=1), "sampling_params.skip_special_tokens", "got `int`"),
             (PoolingParams(dimensions="3"), "sampling_params.dimensions", "got `str`")]
    for params, parameter, expected in cases:
        with pytest.raises(BridgeError) as err:
            check_engine_types("vllm.AsyncLLMEngine.generate", "sampling_params", params)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.parameter == parameter, err.value
        assert expected in err.value.message and "engine core" in err.value.message, err.value.message
    with pytest.raises(BridgeError) as err:
        check_engine_types("vllm.AsyncLLMEngine.generate", "lora_request",
                           LoRARequest(lora_name="a", lora_int_id=1, lora_path="/x", base_model_name=3))  # type: ignore[arg-type]
    assert err.value.parameter == "lora_request.base_model_name", err.value
    check_engine_types("g", "sampling_params", SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA,
                                                              stop=["x"], seed=4))
    check_engine_types("g", "sampling_params", {"output_kind": True})      # not a struct: the binding's to check


@pytest.mark.parametrize(("words", "said"), [(["ok", ""], "an empty string"), (["ok", " "], "whitespace only"),
                                           (["ok", "\t\u3000"], "whitespace only")])
def test_an_empty_bad_word_is_named(catalog: Catalog, words: list[str], said: str) -> None:
    """vLLM strips each bad word's leading whitespace, tokenizes it and indexes its first token: an
    empty word, or one of whitespace only, failed as a bare IndexError."""
    with pytest.raises(BridgeError) as err:
        bind(catalog, "vllm.AsyncLLMEngine.generate", "Hi", {"bad_words": words}, "r")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.parameter == "sampling_params.bad_words[1]", err.value
    assert f"expected a word, got {said}" in err.value.message


def test_a_bad_word_the_tokenizer_makes_nothing_of_is_named() -> None:
    """What a tokenizer's normalizer drops makes no token either (vLLM's bare IndexError again): the
    engine's own tokenizer is asked. Here a real one whose normalizer drops every "z"."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from vllm import SamplingParams

    from adapters.engine_requests import check_sampling_params

    inner = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    inner.normalizer = normalizers.Replace("z", "")
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    engine = types.SimpleNamespace(tokenizer=PreTrainedTokenizerFast(tokenizer_object=inner),
                                   model_config=types.SimpleNamespace(get_vocab_size=lambda: 3))
    check_sampling_params(engine, "g", "sampling_params", SamplingParams(max_tokens=2, bad_words=["a", "b z"]))
    with pytest.raises(BridgeError) as err:
        check_sampling_params(engine, "g", "sampling_params", SamplingParams(max_tokens=2, bad_words=["a", "zz"]))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.parameter == "sampling_params.bad_words[1]", err.value
    assert "'zz', of which this engine's tokenizer makes no token" in err.value.message


def test_a_record_may_name_its_type_as_its_constructor_is_named(catalog: Catalog) -> None:
    """A client that makes `vllm.PoolingParams(...)` may send a Record of type `vllm.PoolingParams`
    too: it was not allow-listed under that name, so its fields arrived as a plain map, which the
    parameter then built as the union's first class (SamplingParams)."""
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams
    assert catalog.resolve_type("vllm.PoolingParams") is PoolingParams
    assert catalog.resolve_type("vllm.SamplingParams") is SamplingParams
    assert catalog.resolve_type("vllm.pooling_params.PoolingParams") is PoolingParams
    assert catalog.resolve_type("vllm.NoSuchParams") is None


@pytest.mark.parametrize(("params", "parameter", "said"), [
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "sampling_params.structured_outputs",
     "You can only use one kind of structured outputs constraint"),
    ({"best_of": 2}, "sampling_params.best_of", "unexpected keyword argument 'best_of'"),
])
def test_what_a_record_refuses_is_said_by_field_without_pydantics_dump(catalog: Catalog, params: dict[str, Any],
                                                                       parameter: str, said: str) -> None:
    """pydantic's text of a refused record lists every input (private fields too), its internals'
    names and a web address; an unknown key was named in the message but not as the parameter."""
    with pytest.raises(BridgeError) as err:
        bind(catalog, "vllm.AsyncLLMEngine.generate", "Hi", params, "r")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.parameter == parameter, err.value
    assert said in err.value.message and "input_value" not in err.value.message, err.value.message
    assert "pydantic.dev" not in err.value.message and "_backend" not in err.value.message, err.value.message


@pytest.mark.parametrize("kwargs,parameter", [({"temperature": float("nan")}, "temperature"),
                                              ({"max_tokens": 4, "logit_bias": {5: float("inf")}}, "logit_bias")])
def test_a_record_made_by_its_constructor_takes_no_nan_as_a_map_takes_none(
        catalog: Catalog, kwargs: dict[str, Any], parameter: str) -> None:
    """A map given to generate with a NaN was refused; the same values given to SamplingParams'
    constructor made a ref that generate then took."""
    entry = catalog.entries["vllm.SamplingParams"]
    assert entry.signature is not None and entry.kind is Kind.CONSTRUCTOR
    with pytest.raises(BridgeError) as err:
        bind_arguments(entry.name, entry.signature, [], kwargs, Building(catalog.short_types, catalog.rule),
                       checks_of(entry), constructs=entry.owner)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.parameter == parameter, err.value
    assert "expected a finite number" in err.value.message, err.value.message
