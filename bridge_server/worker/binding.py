"""Binding a call's arguments to the signature of what it calls, before anything runs.

Every argument mistake is caught here and named (function, parameter, what the signature says), so
a client learns what is wrong without the call reaching vLLM. Maps given where a parameter expects
one of the catalog's config classes are built into that class here too.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from bridge_server.wire.errors import BridgeError

_TYPEERROR_PARAM = re.compile(r"'(\w+)'")


def bind_arguments(label: str, signature: inspect.Signature, args: list[Any], kwargs: dict[str, Any],
                   types: Mapping[str, type]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments as the callee will receive them; INVALID_ARGUMENT naming the parameter if not."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        m = _TYPEERROR_PARAM.search(str(exc))
        raise BridgeError.validation(f"{label}{_short_sig(signature)}: {exc}", target=label,
                                     parameter=m.group(1) if m else "") from None
    for pname, value in bound.arguments.items():
        if isinstance(value, dict):
            built = _build_argument(label, signature.parameters[pname], value, types)
            if built is not value:
                bound.arguments[pname] = built
    return list(bound.args), dict(bound.kwargs)


def _build_argument(label: str, param: inspect.Parameter, value: dict[Any, Any], types: Mapping[str, type]) -> Any:
    """A map given where the signature expects one of the catalog's classes is built into it.

    Keys are checked against the class's signature first: vLLM's pydantic configs silently drop
    unknown fields, and a misspelt option must not be ignored.
    """
    annotation = param.annotation if isinstance(param.annotation, str) else repr(param.annotation)
    for short, cls in types.items():
        if not re.search(rf"\b{short}\b", annotation):
            continue
        fields = {str(k): v for k, v in value.items()}
        where = f"{label}: parameter {param.name}: cannot build {short} from the map given"
        try:
            _class_signature(cls).bind(**fields)
        except TypeError as exc:
            raise BridgeError.validation(f"{where}: {exc}", target=label, parameter=param.name) from None
        except ValueError:
            pass   # no introspectable signature: let the class judge
        try:
            return cls(**fields)
        except Exception as exc:  # the class's own validation says what is wrong
            why = _field_types_error(cls, fields) or f"{type(exc).__name__}: {exc}"
            raise BridgeError.validation(f"{where}: {why}", target=label, parameter=param.name) from None
    return value


def _field_types_error(cls: type, fields: dict[str, Any]) -> str | None:
    """For msgspec structs (SamplingParams), msgspec's own check of the declared field types, which
    names the field and the expected and given types, where the class's error may name neither."""
    if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        return None
    try:
        msgspec.convert(fields, cls)
    except msgspec.ValidationError as exc:   # "Expected `int`, got `str` - at `$.max_tokens`"
        return f"field {str(exc).rpartition('$.')[2].rstrip('`')}: {str(exc).partition(' - at ')[0]}" \
            if " - at `$." in str(exc) else str(exc)
    except Exception:   # a field type msgspec cannot check: the class's error stands
        return None
    return None


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


@functools.lru_cache(maxsize=256)
def _class_signature(cls: type) -> inspect.Signature:
    """Resolving a config class's signature walks its type hints: once per class, not per request."""
    return inspect.signature(cls)


def _short_sig(sig: inspect.Signature) -> str:
    return "(" + ", ".join(str(p).split(":")[0].split("=")[0].strip() for p in sig.parameters.values()) + ")"


