"""JSON spellings of bridge values, for the command line.

Plain JSON covers null, booleans, numbers, strings, lists and string-keyed objects. Everything else
is an object with one `$`-key: {"$ref": ID}, {"$tuple": [...]}, {"$set": [...]}, {"$atom": NAME},
{"$bytes": BASE64}, {"$map": [[K, V], ...]}, {"$float": "nan" | "inf" | "-inf"},
{"$tensor": {"dtype": D, "shape": [...], "values": [...]}} and, in output only,
{"$record": TYPE, "fields": {...}} and {"$enum": TYPE, "name": N}.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

from vllm_bridge.v1 import bridge_pb2 as pb


def _tensor_from(spec: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, str(spec.get("dtype", "float32")))
    t = torch.tensor(spec.get("values", []), dtype=dtype)
    return t.reshape(spec["shape"]) if "shape" in spec else t


def from_json(obj: Any) -> Any:
    """JSON (as parsed) -> the Python value to send."""
    if isinstance(obj, list):
        return [from_json(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (key, val), = obj.items()
        if key == "$ref":
            return pb.Ref(id=str(val))
        if key == "$tuple":
            return tuple(from_json(x) for x in val)
        if key == "$set":
            return {from_json(x) for x in val}
        if key == "$atom":
            return str(val)
        if key == "$bytes":
            return base64.b64decode(val)
        if key == "$map":
            return {_hashable(from_json(k)): from_json(v) for k, v in val}
        if key == "$float":
            return float(val)
        if key == "$tensor":
            return _tensor_from(val)
    return {k: from_json(v) for k, v in obj.items()}


def _hashable(x: Any) -> Any:
    return tuple(_hashable(i) for i in x) if isinstance(x, list) else x


def to_json(value: Any) -> Any:
    """A decoded result -> JSON-able data that says exactly what the value was."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, pb.Ref):
        return {"$ref": value.id, "type": value.type_name, "session": value.session_id}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, list):
        return [to_json(x) for x in value]
    if isinstance(value, tuple):
        return {"$tuple": [to_json(x) for x in value]}
    if isinstance(value, (set, frozenset)):
        return {"$set": [to_json(x) for x in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: to_json(v) for k, v in value.items()}
        return {"$map": [[to_json(k), to_json(v)] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        values = value.float().tolist() if value.dtype in (torch.bfloat16,) else value.tolist()
        return {"$tensor": {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                            "values": to_json(values)}}
    if hasattr(value, "type_name") and hasattr(value, "name"):   # an enum member the client cannot rebuild
        return {"$enum": value.type_name, "name": value.name}
    return {"$repr": repr(value)}
