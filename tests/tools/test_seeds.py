"""The committed surfaces (adapters/surfaces/*.json) are what the binding documents say.

The documents live in ../shared/seeds beside the repository root. They are required here: without
them nothing can show that the committed surfaces are right, so their absence is a failure, not a
skip. The concrete assertions below pin down the irregular spots of each document layout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from adapters.surface import DocEntry, DocParam, DocSurface, dumps, from_json, to_json
from bridge_server.tools.seeds import load_surfaces, main, parse_document

REPO = Path(__file__).resolve().parents[2]
SEEDS = Path(__file__).resolve().parents[3] / "shared" / "seeds"
COMMITTED = REPO / "adapters" / "surfaces"
KEYS = {"forward_context", "async_llm", "distributed", "dp_metadata"}


@pytest.fixture(scope="module")
def seeds_dir() -> Path:
    if not SEEDS.is_dir():
        pytest.fail(f"binding documents not found at {SEEDS}: the surfaces cannot be checked "
                    "without ../shared/seeds beside the repository root")
    return SEEDS


@pytest.fixture(scope="module")
def surfaces(seeds_dir: Path) -> dict[str, DocSurface]:
    return load_surfaces(seeds_dir)


def entry(surface: DocSurface, name: str) -> DocEntry:
    found = [e for e in surface.entries if e.name == name]
    assert len(found) == 1, f"{surface.document}: expected one entry {name!r}, found {len(found)}"
    return found[0]


def shape(e: DocEntry) -> list[tuple[str, str, bool, str | None, bool]]:
    return [(p.name, p.type, p.has_default, p.default, p.keyword_only) for p in e.params]


# --- the committed files --------------------------------------------------------------------


def test_committed_surface_files_equal_a_fresh_parse_of_the_seeds(
        surfaces: dict[str, DocSurface]) -> None:
    assert set(surfaces) == KEYS
    assert {p.stem for p in COMMITTED.glob("*.json")} == KEYS, "stale or missing surface files"
    for key, surface in surfaces.items():
        text = (COMMITTED / f"{key}.json").read_text(encoding="utf-8")
        assert text == dumps(surface), (
            f"adapters/surfaces/{key}.json is out of date; regenerate with "
            "`python -m bridge_server.tools.seeds ../shared/seeds adapters/surfaces`")


def test_json_round_trip_gives_back_the_same_surface(surfaces: dict[str, DocSurface]) -> None:
    for surface in surfaces.values():
        assert from_json(json.loads(json.dumps(to_json(surface)))) == surface


def test_main_writes_deterministic_sorted_files(seeds_dir: Path, tmp_path: Path) -> None:
    assert main([str(seeds_dir), str(tmp_path / "a")]) == 0
    assert main([str(seeds_dir), str(tmp_path / "b")]) == 0
    for key in KEYS:
        a = (tmp_path / "a" / f"{key}.json").read_text(encoding="utf-8")
        assert a == (tmp_path / "b" / f"{key}.json").read_text(encoding="utf-8")
        assert a.endswith("}\n") and a == json.dumps(json.loads(a), sort_keys=True, indent=2) + "\n"


def test_python_reference_page_001_is_not_a_surface(surfaces: dict[str, DocSurface]) -> None:
    assert all(not s.document.startswith("001") for s in surfaces.values())


# --- every surface --------------------------------------------------------------------------


def test_entry_counts_per_surface(surfaces: dict[str, DocSurface]) -> None:
    counts = {key: len(s.entries) for key, s in surfaces.items()}
    assert counts == {"forward_context": 18, "async_llm": 37, "distributed": 60,
                      "dp_metadata": 7}


def test_each_surface_names_its_elixir_module_and_python_target(
        surfaces: dict[str, DocSurface]) -> None:
    got = {k: (s.elixir_module, s.python_module, s.python_class) for k, s in surfaces.items()}
    assert got == {
        "forward_context": ("Vllm.ForwardContext.Module", "vllm.forward_context", None),
        "async_llm": ("Vllm.AsyncLLMEngine", "vllm", "AsyncLLMEngine"),
        "distributed": ("Vllm.Distributed", "vllm.distributed", None),
        "dp_metadata": ("Vllm.ForwardContext.DPMetadata", "vllm.forward_context", "DPMetadata"),
    }


def test_entry_names_are_unique_and_no_return_type_became_an_entry(
        surfaces: dict[str, DocSurface]) -> None:
    # A "Returns" line such as ``term()`` or a one-line ``a(term())b(term())`` parameter list
    # looks like a heading; mistaking it for one would invent entries like these.
    for surface in surfaces.values():
        names = [e.name for e in surface.entries]
        assert len(names) == len(set(names)), surface.document
        assert not {"term", "boolean", "integer", "list", "max_tokens_across_dp_cpu"} & set(names)


def test_receiver_ref_and_opts_are_never_parameters(surfaces: dict[str, DocSurface]) -> None:
    for surface in surfaces.values():
        for e in surface.entries:
            for p in e.params:
                assert p.type not in ("SnakeBridge.Ref.t()", "keyword()"), (e.name, p)
                assert p.name not in ("opts", "ref"), (e.name, p)


def test_no_required_parameter_follows_an_optional_positional_one(
        surfaces: dict[str, DocSurface]) -> None:
    # Python's own rule; a violation means a default was lost or invented.
    for surface in surfaces.values():
        for e in surface.entries:
            positional = [p for p in e.params if not p.keyword_only]
            first_optional = next((i for i, p in enumerate(positional) if p.has_default), None)
            if first_optional is not None:
                assert all(p.has_default for p in positional[first_optional:]), e.name


def test_attributes_take_no_parameters_and_only_the_receiver(
        surfaces: dict[str, DocSurface]) -> None:
    for key, surface in surfaces.items():
        receiver = 1 if surface.python_class else 0
        for e in surface.entries:
            if e.attribute:
                assert e.params == () and e.arities == (receiver,), (key, e.name)


# --- forward_context (module page with one heading per arity) -------------------------------


def test_forward_context_set_forward_context_has_all_eight_documented_params(
        surfaces: dict[str, DocSurface]) -> None:
    e = entry(surfaces["forward_context"], "set_forward_context")
    assert shape(e) == [
        ("attn_metadata", "term()", False, None, False),
        ("vllm_config", "term()", False, None, False),
        ("virtual_engine", "integer()", True, "0", False),
        ("num_tokens", "term()", True, "None", False),
        ("num_tokens_across_dp", "term()", True, "None", False),
        ("cudagraph_runtime_mode", "term()", True, "<CUDAGraphMode.NONE: 0>", False),
        ("batch_descriptor", "term()", True, "None", False),
        ("ubatch_slices", "term()", True, "None", False),
    ]
    assert e.arities == (2, 3, 4, 5, 6, 7, 8, 9)
    assert e.returns == "term()" and not e.attribute
    assert e.summary == "A context manager that stores the current forward context,"


def test_forward_context_prose_bullets_take_names_from_widest_heading_types_from_spec(
        surfaces: dict[str, DocSurface]) -> None:
    e = entry(surfaces["forward_context"], "coordinate_batch_across_dp")
    assert shape(e) == [
        ("num_tokens_unpadded", "integer()", False, None, False),
        ("allow_microbatching", "boolean()", False, None, False),
        ("allow_dp_padding", "boolean()", False, None, False),
        ("parallel_config", "term()", False, None, False),
        # Optional (absent from the 4-argument heading) but the default is not documented.
        ("num_tokens_padded", "term()", True, None, False),
        ("uniform_decode", "term()", True, None, False),
        ("num_scheduled_tokens_per_request", "term()", True, None, False),
        ("cudagraph_mode", "integer()", True, None, False),
    ]
    assert e.arities == (4, 5, 6, 7, 8, 9)
    assert e.returns == "{boolean(), term(), integer()}"


def test_forward_context_module_attributes_are_flagged(surfaces: dict[str, DocSurface]) -> None:
    attributes = {e.name for e in surfaces["forward_context"].entries if e.attribute}
    assert attributes == {"_forward_context", "batchsize_forward_time",
                          "batchsize_logging_interval", "current_platform", "forward_start_time",
                          "last_logging_time", "logger", "track_batchsize"}
    assert entry(surfaces["forward_context"], "track_batchsize").returns == "boolean()"
    # Zero-argument functions that take opts are functions, not attributes.
    assert not entry(surfaces["forward_context"], "get_forward_context").attribute
    assert not entry(surfaces["forward_context"], "u_batch_slices").attribute


def test_forward_context_returns_and_summaries(surfaces: dict[str, DocSurface]) -> None:
    fc = surfaces["forward_context"]
    assert entry(fc, "_compute_sp_num_tokens").returns == "list(integer())"
    assert entry(fc, "get_forward_context").returns == "Vllm.ForwardContext.t()"
    assert entry(fc, "init_logger").summary == (
        "The main purpose of this function is to ensure that loggers are")
    assert shape(entry(fc, "init_logger")) == [("name", "String.t()", False, None, False)]


def test_forward_context_heading_arities_match_spec_derived_arities(
        seeds_dir: Path, surfaces: dict[str, DocSurface]) -> None:
    # Flattened documents have no headings, so arities come from specs there; this checks the
    # rule "a spec ending in keyword() also gives arity n - 1" against the page that has both.
    text = next(seeds_dir.glob("000_*.txt")).read_text(encoding="utf-8")
    from_headings: dict[str, set[int]] = {}
    for name, args in re.findall(r"^(\w+)\((.*)\)\n\n@spec", text, re.M):
        parts = [a for a in args.split(", ") if a]
        arities = from_headings.setdefault(name, set())
        arities.add(len(parts))
        if parts and parts[-1] == "opts \\\\ []":
            arities.add(len(parts) - 1)
    assert len(from_headings) == 18
    for e in surfaces["forward_context"].entries:
        assert set(e.arities) == from_headings[e.name], e.name


# --- distributed (flattened module page) ----------------------------------------------------


def test_distributed_divide_and_get_pp_indices(surfaces: dict[str, DocSurface]) -> None:
    d = surfaces["distributed"]
    assert shape(entry(d, "divide")) == [("numerator", "term()", False, None, False),
                                         ("denominator", "term()", False, None, False)]
    e = entry(d, "get_pp_indices")
    assert [p.name for p in e.params] == ["num_hidden_layers", "pp_rank", "pp_size"]
    assert {p.type for p in e.params} == {"integer()"} and e.arities == (3, 4)
    assert e.returns == "{integer(), integer()}"


def test_distributed_defaults_keep_their_documented_text(surfaces: dict[str, DocSurface]) -> None:
    e = entry(surfaces["distributed"], "init_distributed_environment")
    assert [(p.name, p.default) for p in e.params] == [
        ("world_size", "-1"), ("rank", "-1"), ("distributed_init_method", "'env://'"),
        ("local_rank", "-1"), ("backend", "'nccl'"), ("timeout", "None")]
    tags = entry(surfaces["distributed"], "direct_register_custom_op").params[-1]
    assert (tags.name, tags.type, tags.default) == ("tags", "{term(), term()}", "()")


def test_distributed_prose_returns_line_yields_the_type(surfaces: dict[str, DocSurface]) -> None:
    # "Returns boolean(). True if this is the global first rank ..." in the document.
    assert entry(surfaces["distributed"], "is_global_first_rank").returns == "boolean()"


def test_distributed_glued_prose_bullet_is_split(surfaces: dict[str, DocSurface]) -> None:
    # "...number of partitions to split the tensorcontiguous_split_chunks- If True, ..."
    e = entry(surfaces["distributed"], "split_tensor_along_last_dim")
    assert shape(e) == [("tensor", "term()", False, None, False),
                        ("num_partitions", "integer()", False, None, False),
                        ("contiguous_split_chunks", "boolean()", True, None, False)]


def test_distributed_stale_prose_list_gets_no_misaligned_types(
        surfaces: dict[str, DocSurface]) -> None:
    # Docstring names 3 parameters but the specs have 4 positional slots, so spec types cannot
    # be matched to names (backend would otherwise be typed integer()).
    e = entry(surfaces["distributed"], "initialize_model_parallel")
    assert shape(e) == [("tensor_model_parallel_size", "term()", True, None, False),
                        ("pipeline_model_parallel_size", "term()", True, None, False),
                        ("backend", "term()", True, None, False)]


def test_distributed_attributes(surfaces: dict[str, DocSurface]) -> None:
    assert {e.name for e in surfaces["distributed"].entries if e.attribute} == {
        "logger", "use_sched_yield"}
    # One spec without opts does not make a function an attribute.
    assert not entry(surfaces["distributed"], "init_model_parallel_group").attribute


# --- async_llm (flattened class page) -------------------------------------------------------


def test_async_llm_generate_keyword_only_params(surfaces: dict[str, DocSurface]) -> None:
    e = entry(surfaces["async_llm"], "generate")
    assert shape(e) == [
        ("prompt", "term()", False, None, False),
        ("sampling_params", "Vllm.SamplingParamsClass.t()", False, None, False),
        ("request_id", "String.t()", False, None, False),
        ("prompt_text", "term()", True, "None", True),
        ("lora_request", "term()", True, "None", True),
        ("tokenization_kwargs", "term()", True, "None", True),
        ("trace_headers", "term()", True, "None", True),
        ("priority", "integer()", True, "0", True),
        ("data_parallel_rank", "term()", True, "None", True),
    ]
    assert e.arities == (4, 5) and e.returns == "term()" and not e.attribute


def test_async_llm_abort_params_and_nil_return(surfaces: dict[str, DocSurface]) -> None:
    e = entry(surfaces["async_llm"], "abort")
    assert shape(e) == [("request_id", "term()", False, None, False),
                        ("internal", "boolean()", True, "False", False)]
    assert e.returns == "nil"
    assert e.summary == "Abort RequestId in OutputProcessor and EngineCore."


def test_async_llm_properties_are_attributes(surfaces: dict[str, DocSurface]) -> None:
    props = {e.name for e in surfaces["async_llm"].entries if e.attribute}
    assert props == {"errored", "is_running", "is_stopped", "dead_error", "tokenizer"}
    e = entry(surfaces["async_llm"], "tokenizer")
    assert (e.summary, e.returns, e.arities) == ("", "", (1,))
    assert not entry(surfaces["async_llm"], "get_tokenizer").attribute


def test_async_llm_constructor_prose_params(surfaces: dict[str, DocSurface]) -> None:
    e = entry(surfaces["async_llm"], "new")
    assert [p.name for p in e.params] == [
        "vllm_config", "executor_class", "log_stats", "usage_context", "mm_registry",
        "use_cached_outputs", "log_requests", "start_engine_loop", "stat_loggers"]
    assert [p.type for p in e.params[:3]] == ["term()", "term()", "boolean()"]
    assert [p.has_default for p in e.params] == [False] * 3 + [True] * 6
    assert not any(p.keyword_only for p in e.params) and e.returns == ""


def test_async_llm_glued_and_keyword_only_prose_params(surfaces: dict[str, DocSurface]) -> None:
    # "...data parallel workersdrain_timeout- Maximum time ..." in the document.
    assert shape(entry(surfaces["async_llm"], "scale_elastic_ep")) == [
        ("new_data_parallel_size", "integer()", False, None, False),
        ("drain_timeout", "term()", True, None, False)]
    # Spec has no positional slot and no optional-argument list: the parameters are keywords.
    assert shape(entry(surfaces["async_llm"], "pause_generation")) == [
        ("wait_for_inflight_requests", "term()", True, None, True),
        ("clear_cache", "term()", True, None, True)]


def test_async_llm_add_request_optional_positionals(surfaces: dict[str, DocSurface]) -> None:
    e = entry(surfaces["async_llm"], "add_request")
    assert len(e.params) == 10 and e.params[-1].name == "prompt_text"
    assert [p.name for p in e.params if not p.has_default] == ["request_id", "prompt", "params"]
    assert not any(p.keyword_only for p in e.params)


# --- dp_metadata (flattened class page) -----------------------------------------------------


def test_dp_metadata_constructor_and_local_sizes_property(
        surfaces: dict[str, DocSurface]) -> None:
    dp = surfaces["dp_metadata"]
    e = entry(dp, "new")
    assert shape(e) == [("max_tokens_across_dp_cpu", "term()", False, None, False),
                        ("num_tokens_across_dp_cpu", "term()", False, None, False),
                        ("local_sizes", "term()", True, "None", False)]
    assert e.arities == (3, 4) and not e.attribute
    assert entry(dp, "local_sizes").attribute
    assert [e.name for e in dp.entries if e.attribute] == ["local_sizes"]


def test_dp_metadata_prose_params_typed_from_spec(surfaces: dict[str, DocSurface]) -> None:
    dp = surfaces["dp_metadata"]
    assert shape(entry(dp, "chunked_sizes")) == [
        ("sequence_parallel_size", "integer()", False, None, False),
        ("max_chunk_size_per_rank", "integer()", False, None, False),
        ("chunk_idx", "integer()", False, None, False)]
    assert entry(dp, "make").returns == "Vllm.ForwardContext.DPMetadata.t()"


# --- synthetic documents: failure modes -----------------------------------------------------


def test_unknown_glued_prose_name_is_an_error_not_a_guess() -> None:
    doc = ("@spec f(SnakeBridge.Ref.t(), term(), [term()], keyword()) :: {:ok, term()} | "
           "{:error, Snakepit.Error.t()}\nDo f.\nParameters\n"
           "alpha- the first onebeta_gamma- the second\nReturns\nterm()\n")
    with pytest.raises(ValueError, match="onebeta_gamma"):
        parse_document("999_x.txt", doc)


def test_flattened_class_document_minimal() -> None:
    doc = ("@spec f(SnakeBridge.Ref.t(), integer(), keyword()) :: {:ok, nil} | "
           "{:error, Snakepit.Error.t()}\nDo f.\nParameters\nn(integer() default: 3)\n"
           "Returns\nnil\n@spec p(SnakeBridge.Ref.t()) :: {:ok, term()} | "
           "{:error, Snakepit.Error.t()}\n")
    s = parse_document("999_x.txt", doc)
    assert s.entries == (
        DocEntry("f", (2, 3), (DocParam("n", "integer()", True, "3", False),), "nil", "Do f.",
                 False),
        DocEntry("p", (1,), (), "", "", True))
