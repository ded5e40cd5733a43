"""Binding a call's arguments to the signature of what it calls, and checking their types, before
anything runs.

Every argument mistake is caught here and named (function, parameter, field, expected and given
type), so a client learns what is wrong without the call reaching vLLM. That matters beyond the
message: vLLM checks many values only later, in another thread or process (its engine core's input
thread dies on msgspec's type check of a float `max_tokens` or an int `request_id`, and the engine
then hangs every later request). So each argument is checked, strictly, against the installed vLLM's
annotation of its parameter (or, where vLLM has none, the type the binding documents give), with
pydantic in strict mode: an int parameter takes an int, not a float or a bool; a str takes a str.
The checks are derived from the signatures and the record types, never listed by hand, and built
on first use, once per parameter.

Maps given where a parameter expects one of the catalog's record classes (SamplingParams, ...) are
built into that class here, each given field checked the same way first; non-finite numbers are
refused in them (nothing in vLLM's request records can use nan or inf). Enum-typed values may be
given by value as well as by member, as vLLM's own structs accept; a map for a nested record field
(SamplingParams' `structured_outputs`) is left to the enclosing class to build.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import inspect
import math
import re
import sys
import traceback
import types as pytypes
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc
import msgspec
import pydantic
import typing_extensions

from adapters.spec import Policy, RecordRule
from bridge_server.wire.errors import BridgeError, clip, quote

_TYPEERROR_PARAM = re.compile(r"'(\w+)'")
_STRICT = pydantic.ConfigDict(strict=True, arbitrary_types_allowed=True)
# The binding documents' types, for parameters the installed vLLM does not annotate.
_DOC_TYPES: dict[str, Any] = {"integer()": int, "float()": float, "number()": float, "String.t()": str,
                              "boolean()": bool, "map()": dict, "binary()": bytes}


@dataclasses.dataclass(frozen=True)
class Building:
    """How maps become records: the classes a map may be built into (by bare name, to match against
    annotations), what a client may set on each (`RecordRule`), and the operator's policy."""

    types: Mapping[str, type]
    rule: Callable[[type], RecordRule | None] = lambda cls: None
    policy: Policy = Policy()
    _named: dict[str, tuple[type, ...]] = dataclasses.field(default_factory=dict, repr=False, compare=False,
                                                            hash=False)

    def record_for(self, annotation: Any) -> type | None:
        """The class a parameter's annotation names, if it names one of `types` (the first, of a union)."""
        named = self._classes_in(annotation)
        return named[0] if named else None

    def others_named(self, annotation: Any, cls: type) -> list[str]:
        """The other classes of `types` an annotation names besides `cls` (a union of records)."""
        return [c.__name__ for c in self._classes_in(annotation) if c is not cls]

    def _classes_in(self, annotation: Any) -> tuple[type, ...]:
        """The classes of `types` an annotation names, in the order of `types`: searched once per
        annotation, as a request's map arguments are built on every call."""
        text = annotation if isinstance(annotation, str) else repr(annotation)
        try:
            return self._named[text]
        except KeyError:
            pass
        found = tuple(cls for short, cls in self.types.items() if re.search(rf"\b{short}\b", text))
        if len(self._named) < 4096:
            self._named[text] = found
        return found


def bind_arguments(label: str, signature: inspect.Signature, args: list[Any], kwargs: dict[str, Any],
                   building: Building, checks: Checks | None = None,
                   constructs: type | None = None) -> tuple[list[Any], dict[str, Any]]:
    """The arguments as the callee will receive them; INVALID_ARGUMENT naming the parameter if not.
    For a constructor of a record class (`constructs`), its `RecordRule` applies to the arguments as
    it would to a map's fields."""
    bound = bind_checked(label, signature, args, kwargs, building, checks, constructs)
    return list(bound.args), dict(bound.kwargs)


def bind_checked(label: str, signature: inspect.Signature, args: list[Any], kwargs: dict[str, Any],
                 building: Building, checks: Checks | None = None,
                 constructs: type | None = None) -> inspect.BoundArguments:
    """bind_arguments, as the bound arguments themselves: a guard reads them by name, and binding
    them again for it cost every request as much as binding them did."""
    _no_private(label, "", constructs, kwargs)
    try:
        bound = _bind_plainly(signature, args, kwargs) or signature.bind(*args, **kwargs)
    except TypeError as exc:
        m = _TYPEERROR_PARAM.search(str(exc))
        raise BridgeError.validation(f"{label}{_short_sig(signature)}: {exc}", target=label,
                                     parameter=m.group(1) if m else "") from None
    _no_private(label, "", constructs, bound.arguments)     # a private parameter given by position
    rule = building.rule(constructs) if constructs is not None else None
    if rule is not None and constructs is not None:
        _allowed_fields(label, "", constructs, bound.arguments, rule)
    for pname, value in bound.arguments.items():
        param = signature.parameters[pname]
        if isinstance(value, dict) and param.kind is not inspect.Parameter.VAR_KEYWORD:
            built = _build_argument(label, param, value, building)
            if built is not value:
                bound.arguments[pname] = value = built
        if checks is not None:
            given = checks.check(label, param, value)
            if given is not value:
                bound.arguments[pname] = given
        if constructs is not None and (bad := _non_finite(value)) is not None:
            # as in a map built into the record (`check_record`): a SamplingParams made by its
            # constructor took the NaN a map given to generate was refused
            raise BridgeError.validation(f"{label}: parameter {pname}: expected a finite number, got {bad}",
                                         target=label, parameter=pname)
    if rule is not None and rule.check is not None:
        rule.check(bound.arguments, building.policy)
    return bound


@dataclasses.dataclass(frozen=True)
class _Shape:
    """A signature without *args or **kwargs, as `_bind_plainly` reads it."""

    order: tuple[str, ...]             # every parameter, in order
    positional: tuple[str, ...]        # those that may be given by position, in order
    by_name: frozenset[str]            # those that may be given by name
    required: frozenset[str]           # those without a default


_SHAPES: dict[int, tuple[inspect.Signature, _Shape | None]] = {}   # by id, the signature kept alive with it


def _shape(signature: inspect.Signature) -> _Shape | None:
    held = _SHAPES.get(id(signature))
    if held is not None and held[0] is signature:
        return held[1]
    params = list(signature.parameters.values())
    P = inspect.Parameter
    shape = None if any(p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) for p in params) else _Shape(
        tuple(p.name for p in params),
        tuple(p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)),
        frozenset(p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)),
        frozenset(p.name for p in params if p.default is P.empty))
    if len(_SHAPES) < 4096:
        _SHAPES[id(signature)] = (signature, shape)
    return shape


def _bind_plainly(signature: inspect.Signature, args: list[Any],
                  kwargs: dict[str, Any]) -> inspect.BoundArguments | None:
    """`signature.bind(*args, **kwargs)` where it cannot fail and the signature has no *args or
    **kwargs (a request's call, every time), in a third of its time: what `Signature.bind` checks
    parameter by parameter is checked here with sets worked out once per signature. None where
    `Signature.bind` must judge (and say what is wrong)."""
    shape = _shape(signature)
    if shape is None or len(args) > len(shape.positional):
        return None
    given = dict(zip(shape.positional, args))
    for name in kwargs:
        if name not in shape.by_name or name in given:
            return None
    given.update(kwargs)
    if not shape.required <= given.keys():
        return None
    return inspect.BoundArguments(signature, {n: given[n] for n in shape.order if n in given})


# ------------------------------------------------------------------------------------------ checks
# Types the wire has no kind for, which a client gives by name instead ("cpu", "bfloat16").
_BY_NAME: dict[Any, Any] = {}


def _by_name(tp: Any) -> Any:
    if not _BY_NAME:
        import torch

        from bridge_server.wire.codec import TORCH_DTYPES
        _BY_NAME.update({torch.device: torch.device, torch.dtype: TORCH_DTYPES.__getitem__})
    return _BY_NAME.get(tp)


@dataclasses.dataclass(frozen=True)
class _Check:
    """One parameter's (or field's) strict type check."""

    expected: str
    adapter: pydantic.TypeAdapter[Any]
    named: Any = None                  # builds the value from a name, for a type the wire lacks
    enum: Any = None                   # the enum class the value may be given by value of

    def problem(self, value: Any) -> str | None:
        """None when `value` fits; else what is wrong, as "expected ..., got ..." text."""
        try:
            self.adapter.validate_python((value,))   # a 1-tuple: pydantic takes no config for a bare record type
        except pydantic.ValidationError as exc:
            return _describe(exc, self.expected, value)
        return None

    def member(self, value: Any) -> Any:
        """A value that passed, as it is passed on: an enum given by one of its values becomes that
        member. vLLM compares with members (`output_kind == RequestOutputKind.DELTA`), so a bare 1
        would be taken for no kind at all, and silently ignored."""
        if self.enum is not None and type(value) in (int, str):
            return _members(self.enum).get((type(value), value), value)
        return value


class Checks:
    """The checks of one callable's parameters, each built when the parameter is first given: from
    its annotation (strings resolved in `namespace`, the callable's module), else its documented type."""

    def __init__(self, namespace: Mapping[str, Any], documented: Mapping[str, str] | None = None) -> None:
        self.namespace = namespace
        self.documented = {k.lower(): v for k, v in (documented or {}).items()}
        self._built: dict[str, _Check | None] = {}

    def check(self, label: str, param: inspect.Parameter, value: Any) -> Any:
        """The value to pass on (a device or dtype given by name becomes one); INVALID_ARGUMENT
        naming the parameter when it does not fit."""
        name = param.name
        if name not in self._built:
            self._built[name] = self._make(param)
        check = self._built[name]
        if check is None:
            return value
        if check.named is not None and isinstance(value, str):
            try:
                value = check.named(value)
            except Exception:
                raise BridgeError.validation(f"{label}: parameter {name}: expected {check.expected} (or its name), "
                                             f"got {quote(value)}, which names none", target=label,
                                             parameter=name) from None
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            items: list[tuple[str, Any]] = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            items = [(f"{name}[{k!r}]", v) for k, v in value.items()]
        else:
            items = [(name, value)]
        for where, item in items:
            problem = check.problem(item)
            if problem is not None:
                raise BridgeError.validation(f"{label}: parameter {where}: {problem}", target=label, parameter=name)
        variadic = param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        return value if variadic else check.member(value)

    def _make(self, param: inspect.Parameter) -> _Check | None:
        annotation = _resolve(param.annotation, self.namespace)
        if annotation is None:
            annotation = _documented(self.documented.get(param.name.lower(), ""))
        return None if annotation is None else _check_for(annotation, top=True)


def _resolve(annotation: Any, namespace: Mapping[str, Any]) -> Any:
    """An annotation as a type (None: none, or one that cannot be resolved here)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return None
    if isinstance(annotation, str):
        try:
            annotation = eval(annotation, dict(namespace))   # noqa: S307 - vLLM's own source text, not a client's
        except Exception:
            return None
    return annotation


def _documented(doc_type: str) -> Any:
    if doc_type in _DOC_TYPES:
        return _DOC_TYPES[doc_type]
    inner = re.fullmatch(r"list\((.+)\)", doc_type)
    if inner and (item := _documented(inner.group(1))) is not None:
        return list[item]  # type: ignore[valid-type]
    return None


@functools.lru_cache(maxsize=4096)
def _check_cached(annotation: Any, top: bool) -> _Check | None:
    return _make_check(annotation, top)


def _check_for(annotation: Any, top: bool = False) -> _Check | None:
    try:
        return _check_cached(annotation, top)
    except TypeError:          # an unhashable annotation: built each time it is needed
        return _make_check(annotation, top)


def _make_check(annotation: Any, top: bool) -> _Check | None:
    try:
        adapted = _adapt(annotation, nested=not top)
        adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(tuple[adapted], config=_STRICT)  # type: ignore[valid-type]
        adapter.rebuild(raise_errors=True)   # now, not at the first value: pydantic defers some failures
    except Exception:   # a type pydantic cannot check (vLLM's own checks still apply later)
        return None
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, pytypes.UnionType) \
        else (annotation,)
    named = None if str in members else next((f for m in members if (f := _by_name(m)) is not None), None)
    enums = [m for m in members if isinstance(m, type) and issubclass(m, enum.Enum)]
    return _Check(clip(_type_text(annotation), 160), adapter, named, enums[0] if len(enums) == 1 else None)


@functools.lru_cache(maxsize=256)
def _members(cls: type[enum.Enum]) -> dict[tuple[type, Any], enum.Enum]:
    """An enum's members by (exact type, value): True is not 1 here, as it is not to msgspec."""
    return {(type(m.value), m.value): m for m in cls}


def _not_a_bool(cls: type[enum.Enum]) -> Any:
    """pydantic takes True for the literal 1 (they are equal); msgspec, which vLLM's engine core
    decodes requests with, does not, and its input thread dies on it."""
    def check(value: Any) -> Any:
        if type(value) is bool:
            raise ValueError(f"a bool is not one of {cls.__name__}'s values")
        return value
    return pydantic.BeforeValidator(check)


def _no_callback(value: Any) -> Any:
    """A parameter that takes a function is one a client cannot fill: code is named, never passed,
    and an object of its own that merely has `__call__` (a tokenizer, a context manager) would be
    called back, or registered for every caller of the process (`direct_register_custom_op`)."""
    raise ValueError("a function, which a client cannot pass (code is named, never passed)")


def _is_record_class(tp: Any) -> bool:
    return isinstance(tp, type) and (dataclasses.is_dataclass(tp) or issubclass(tp, (msgspec.Struct, pydantic.BaseModel)))


def _adapt(tp: Any, nested: bool) -> Any:
    """The annotation as checked: an enum may also be given by one of its values (vLLM's structs
    accept that), and a nested record class by a map (its enclosing class builds it)."""
    if tp is Any or isinstance(tp, (typing.ForwardRef, str)):   # Any (a class in 3.11), or a name not resolvable here
        return Any
    if tp is Callable or typing.get_origin(tp) is Callable:
        return typing.Annotated[Any, pydantic.BeforeValidator(_no_callback)]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = tuple(m.value for m in tp)
        if values and all(type(v) in (int, str) for v in values):
            return typing.Annotated[typing.Union[tp, typing.Literal[values]], _not_a_bool(tp)]  # type: ignore[valid-type]
        return tp
    if isinstance(tp, type) and tp.__module__ != "builtins" and not typing_extensions.is_typeddict(tp):
        # Any other class by isinstance alone: some of vLLM's classes bring pydantic schemas of
        # their own (SamplingParams validates as a dict), which would refuse their own instances.
        instance = pydantic.InstanceOf[tp]
        return typing.Union[instance, dict[str, Any]] if nested and _is_record_class(tp) else instance
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is None or not args or origin is typing.Literal:
        return tp
    if origin is typing.Annotated:
        return typing.Annotated[(_adapt(args[0], nested), *tp.__metadata__)]  # type: ignore[return-value]
    new = tuple(_adapt(a, nested if origin in (typing.Union, pytypes.UnionType) else True) for a in args)
    if new == args:
        return tp
    if origin in (typing.Union, pytypes.UnionType):
        return typing.Union[new]
    if hasattr(tp, "copy_with"):
        return tp.copy_with(new)
    return origin[new]


def _type_text(tp: Any) -> str:
    return inspect.formatannotation(tp).replace("typing.", "")


def _describe(exc: pydantic.ValidationError, expected: str, value: Any) -> str:
    """pydantic's findings as one line. Of a union's failures the one that got furthest into the
    value explains it best (a bad item of a list of token ids, rather than "not a str")."""
    errors = exc.errors(include_url=False)
    # (at the same depth, a field of the wrong type says more than a missing one, and the union's
    # member that the value fits best, with the fewest findings, more than the others)
    findings = collections.Counter(tuple(e["loc"][:2]) for e in errors)
    best = max(errors, key=lambda e: (len(e["loc"]), e["type"] != "missing", -findings[tuple(e["loc"][:2])]))
    loc = [p for p in best["loc"][1:] if not (isinstance(p, str) and not p.isidentifier())]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
    got = f"got {type(value).__name__} {quote(value, 60)}"
    if len(best["loc"]) > 2 or (len(errors) == 1 and path):
        return f"expected {expected}, {got}: at {path.lstrip('.') or 'the value'}: {best['msg']}"
    if len(errors) == 1 and best["type"] == "value_error":      # our own check's words say why
        return f"expected {expected}, {got}: {best['msg'].removeprefix('Value error, ')}"
    return f"expected {expected}, {got}"


# ------------------------------------------------------------------------------------------ records
def _build_argument(label: str, param: inspect.Parameter, value: dict[Any, Any], building: Building) -> Any:
    """A map given where the signature expects one of the catalog's classes is built into it."""
    cls = building.record_for(param.annotation)
    if cls is None:
        return value
    try:
        return _build_record(label, param.name, cls, value, building)
    except BridgeError as err:
        others = building.others_named(param.annotation, cls)
        if not others:
            raise
        # `params: SamplingParams | PoolingParams`: a map is built as the first; say how to send another
        raise dataclasses.replace(err, message=f"{err.message} (a map given for {param.name} is built as "
                                               f"{cls.__name__}; for {' or '.join(others)}, send a Record of its type "
                                               f"or a ref to one)") from None


def _build_record(label: str, where: str, cls: type, value: dict[Any, Any], building: Building, depth: int = 0) -> Any:
    """Builds `cls` from a map, once `check_record` has passed it."""
    fields = check_record(label, where, cls, {str(k): v for k, v in value.items()}, building, depth)
    try:
        return cls(**fields)
    except Exception as exc:  # the class's own validation says what is wrong
        why = _field_types_error(cls, fields) or _validation_said(exc) or f"{type(exc).__name__}: {exc}"
        named = f"{where}.{field}" if (field := _refused_field(exc, fields)) else where
        raise BridgeError.validation(f"{label}: parameter {named}: cannot build {cls.__name__} from the map given: "
                                     f"{why}", target=label, parameter=named) from None


def _validation_said(exc: BaseException) -> str | None:
    """What pydantic's ValidationError says, without what its text adds: every input (private fields
    included), its internals' names and a web address."""
    listed = getattr(exc, "errors", None)
    if type(exc).__name__ != "ValidationError" or not callable(listed):
        return None
    try:
        errors = listed()
    except Exception:   # noqa: BLE001 - then its own text it is
        return None
    said = []
    for error in errors[:3]:
        # (a check's own message may end in a dump of the record's fields, private ones included)
        msg = re.sub(r":\s*\{[^{}]*\}\s*$", "", str(error.get("msg", "")).removeprefix("Value error, "))
        loc = ".".join(str(part) for part in error.get("loc", ()) if isinstance(part, (str, int)))
        said.append(f"{loc}: {msg}" if loc else msg)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(said) + more


def _refused_field(exc: BaseException, fields: Mapping[str, Any]) -> str | None:
    """The field a class's own check refused, where it says: vLLM's name it (`parameter`), or start
    their message with it ("top_k must be 0 (disable), or at least 1, got -5"); else the field its
    initializer was setting when it failed (`self.tokenizer = get_model_path(self.tokenizer, ...)`
    raised the hub's "Repo id must be in the form ..." for a tokenizer path that does not exist)."""
    named = getattr(exc, "parameter", None)
    if isinstance(named, str) and named in fields:
        return named
    listed = getattr(exc, "errors", None)
    if type(exc).__name__ == "ValidationError" and callable(listed):
        try:
            locs = [str(e["loc"][0]) for e in listed() if e.get("loc")]
        except Exception:   # noqa: BLE001
            locs = []
        if locs and locs[0] in fields:
            return locs[0]
    first = re.match(r"\w+", str(exc))
    if first is not None and first.group(0) in fields:
        return first.group(0)
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.name in ("__init__", "__post_init__"):
            setting = _SETTING.match(frame.line or "")
            return setting.group(1) if setting is not None and setting.group(1) in fields else None
    return None


_SETTING = re.compile(r"self\.(\w+)\s*(?::[^=]*)?=[^=]")    # `self.field = ...`, `self.field: T = ...`


def check_record(label: str, where: str, cls: type, fields: dict[str, Any], building: Building,
                 depth: int = 0) -> dict[str, Any]:
    """The fields a client gives for a record class, as they may be passed to it (maps for nested
    record fields built). Keys are checked against the class's signature first (vLLM's pydantic
    configs silently drop unknown fields, and a misspelt option must not be ignored), then against
    what the adapter's `RecordRule` lets a client set (PERMISSION_DENIED), then each field's type,
    then the rule's check of the values against the operator's policy."""
    what = f"{label}: parameter {where}: cannot build {cls.__name__} from the map given"
    shape = _keyword_shape(cls)
    if shape is None or not (fields.keys() <= shape[0] and shape[1] <= fields.keys()):
        try:
            _class_signature(cls).bind(**fields)      # what is wrong, in Python's words
        except TypeError as exc:
            unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
            raise BridgeError.validation(f"{what}: {exc}", target=label,
                                         parameter=f"{where}.{unknown.group(1)}" if unknown else where) from None
        except ValueError:
            pass   # no introspectable signature: let the class judge
    _no_private(label, where, cls, fields)
    rule = building.rule(cls)
    if rule is not None:
        _allowed_fields(label, where, cls, fields, rule)
    for field, item in fields.items():
        nested = _nested_record(cls, field) if isinstance(item, dict) and depth < 4 else None
        if nested is not None:
            fields[field] = item = _build_record(label, f"{where}.{field}", nested, item, building, depth + 1)
        problem = _field_problem(cls, field, item)
        if problem is not None:
            raise BridgeError.validation(f"{what}: field {field}: {problem}", target=label,
                                         parameter=f"{where}.{field}")
        check = _field_check(cls, field)
        if check is not None:
            fields[field] = check.member(item)
    if rule is not None and rule.check is not None:
        try:
            rule.check(fields, building.policy)
        except BridgeError as err:
            if err.target == label:
                raise
            # The rule speaks of the class's fields; here they are a parameter's, of this call.
            said = err.message.removeprefix(f"{err.target}: ")
            raise dataclasses.replace(err, message=f"{what}: {said}", target=label,
                                      parameter=f"{where}.{err.parameter}" if err.parameter else where) from None
    return fields


def _no_private(label: str, where: str, cls: type | None, names: Iterable[str]) -> None:
    """A name with a leading underscore is the callee's own bookkeeping, which it derives from what
    its callers give and then trusts (SamplingParams' `_bad_words_token_ids` and `_all_stop_token_ids`
    reach the engine core unchecked: an id outside the vocabulary there kills it). No caller sets one."""
    for key in names:
        if isinstance(key, str) and key.startswith("_"):
            owner = f" on {cls.__name__}" if cls is not None else ""
            kind = "field" if cls is not None else "argument"
            raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                              f"{label}: {f'parameter {where}: ' if where else ''}{kind} {key}{owner} is private "
                              f"(a leading underscore): no client may set it", target=label,
                              parameter=f"{where}.{key}" if where else key, reason="not allowed")


def _allowed_fields(label: str, where: str, cls: type, fields: Mapping[str, Any], rule: RecordRule) -> None:
    if rule.fields is None:
        return
    for key in fields:
        if key not in rule.fields:
            raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                              f"{label}: {f'parameter {where}: ' if where else ''}field {key} is not one a client may "
                              f"set on {cls.__name__} (it may: {', '.join(sorted(rule.fields))})", target=label,
                              parameter=f"{where}.{key}" if where else key, reason="not allowed")


@functools.lru_cache(maxsize=2048)
def _nested_record(cls: type, field: str) -> type | None:
    """The one record class a field's type names (None when it names none, or several)."""
    annotation = _class_hints(cls).get(field)
    candidates = [a for a in (typing.get_args(annotation) or (annotation,)) if _is_record_class(a)]
    return candidates[0] if len(candidates) == 1 else None


def _field_problem(cls: type, field: str, value: Any) -> str | None:
    check = _field_check(cls, field)
    if check is not None and (problem := check.problem(value)) is not None:
        return problem
    bad = _non_finite(value)
    return None if bad is None else f"expected a finite number, got {bad}"


@functools.lru_cache(maxsize=2048)
def _field_check(cls: type, field: str) -> _Check | None:
    annotation = _class_hints(cls).get(field)
    return None if annotation is None else _check_for(annotation, top=True)


@functools.lru_cache(maxsize=256)
def _class_hints(cls: type) -> dict[str, Any]:
    """A record class's field types: resolved all at once, else one by one (vLLM annotates some
    fields with names imported only for type checkers, which cannot be resolved at run time)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:
        pass
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        namespace = vars(sys.modules.get(klass.__module__, sys))
        for name, raw in vars(klass).get("__annotations__", {}).items():
            resolved = _resolve(raw, namespace)
            if resolved is not None:
                hints[name] = resolved
    return hints


def _non_finite(value: Any, depth: int = 0) -> str | None:
    """The first nan or inf in a value (containers looked into), as text; None when there is none."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if depth < 8 and isinstance(value, (list, tuple, set, frozenset)):
        return next((bad for v in value if (bad := _non_finite(v, depth + 1)) is not None), None)
    if depth < 8 and isinstance(value, dict):
        return next((bad for v in value.values() if (bad := _non_finite(v, depth + 1)) is not None), None)
    return None


def _field_types_error(cls: type, fields: dict[str, Any]) -> str | None:
    """For msgspec structs (SamplingParams), msgspec's own check of the declared field types, which
    names the field and the expected and given types, where the class's error may name neither."""
    if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        return None
    if getattr(getattr(cls, "__struct_config__", None), "array_like", False):
        return None       # converted from a list only: a map is "the wrong type" whatever its fields
    # an enum field's value has become its member by now (`check_record`), which msgspec converts
    # from its value only: the member would be blamed for whatever the class refused
    given = {k: v.value if isinstance(v, enum.Enum) else v for k, v in fields.items()}
    try:
        msgspec.convert(given, cls)
    except msgspec.ValidationError as exc:   # "Expected `int`, got `str` - at `$.max_tokens`"
        return f"field {str(exc).rpartition('$.')[2].rstrip('`')}: {str(exc).partition(' - at ')[0]}" \
            if " - at `$." in str(exc) else str(exc)
    except Exception:   # a field type msgspec cannot check: the class's error stands
        return None
    return None


# ------------------------------------------------------------------------------------------ signatures
def member_signature(cls: type, name: str, member: Any) -> inspect.Signature | None:
    """A method's signature, computed once per class and name (it is the same for every instance);
    anything else (an instance attribute holding a callable) is inspected each time."""
    if inspect.ismethod(member) and member.__func__ is getattr(cls, name, None):
        return _method_signature(cls, name)
    try:
        return inspect.signature(member)
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=1024)
def _method_signature(cls: type, name: str) -> inspect.Signature | None:
    try:
        params = list(inspect.signature(getattr(cls, name)).parameters.values())[1:]   # without self
    except (TypeError, ValueError):
        return None
    return inspect.Signature(params)


@functools.lru_cache(maxsize=1024)
def member_checks(cls: type, name: str, documented: tuple[tuple[str, str], ...] = ()) -> Checks:
    """The checks of a method's parameters, once per class and name."""
    return Checks(namespace_of(getattr(cls, name, None)), dict(documented))


def namespace_of(obj: Any) -> Mapping[str, Any]:
    """Where the names in obj's annotations resolve: its module's globals."""
    target = obj.__func__ if inspect.ismethod(obj) else obj
    if isinstance(target, type):
        return vars(sys.modules.get(target.__module__, sys))
    globals_ = getattr(inspect.unwrap(target), "__globals__", None) if callable(target) else None
    return globals_ if globals_ is not None else {}


@functools.lru_cache(maxsize=256)
def _class_signature(cls: type) -> inspect.Signature:
    """Resolving a config class's signature walks its type hints: once per class, not per request."""
    return inspect.signature(cls)


@functools.lru_cache(maxsize=256)
def _keyword_shape(cls: type) -> tuple[frozenset[str], frozenset[str]] | None:
    """The names `cls(**fields)` accepts and those it requires, where that is all binding checks
    (None otherwise): a map whose keys fit binds without binding it, which for a record of ~35 fields
    (SamplingParams) is most of what a request's arguments cost to check."""
    try:
        sig = _class_signature(cls)
    except (TypeError, ValueError):
        return None
    accepted: set[str] = set()
    required: set[str] = set()
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD or (p.kind is inspect.Parameter.POSITIONAL_ONLY
                                                       and p.default is inspect.Parameter.empty):
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            accepted.add(p.name)
            if p.default is inspect.Parameter.empty:
                required.add(p.name)
    return frozenset(accepted), frozenset(required)


def _short_sig(sig: inspect.Signature) -> str:
    return "(" + ", ".join(str(p).split(":")[0].split("=")[0].strip() for p in sig.parameters.values()) + ")"

