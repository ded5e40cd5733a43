"""Stream items as patches (`STREAM_ENCODING_PATCH_V1` in the .proto): the sender's diff (the
receiver's apply is `streamstate.py`).

Why: a generation streams one `RequestOutput` per token, a record of ~30 fields of which a token or
two change (the text and token ids grow, a few timestamps move, `finished` flips once). Encoding the
whole record for every item was most of what the worker spent per streamed token. Here each item
after the first carries only what changed since the item before it: ops that set a Value, or append
to a string, a packed int list or a list, at a path of field and item positions.

The receiver (`StreamState`) keeps the latest item's Value and applies each patch to it, so what it
decodes is exactly the Value the full encoding would have sent for that item: the sender's diff
(`Patcher`) mirrors every choice the `Encoder` makes (kinds, field order, packed ints, refs for what
is too deep or cyclic) and sends a whole Value wherever it cannot show that a part stays as it was.

The sender compares each item with a *shadow* of the previous one: a private copy of what it was
encoded from (strings and numbers as they were, int lists copied, records and lists as shadows of
their parts). Identity is never taken for sameness of anything mutable: vLLM appends to a request's
token id and logprob lists in place and reuses its stats object, so an item's lists may be the very
objects of the item before, changed since.

Except where an adapter says so. A list compared item by item costs, at every step, time in
proportion to its length: a generation's token ids, and worse its logprobs (a dict per token),
would make each item of a long generation dearer than the one before, and the whole stream
quadratic. So fields that an adapter declares growing (`adapters.spec.Growing`: one list, only
appended to, through the stream) are compared by their new items only, while they are still the
very list the last item held; any other list in their place is compared whole, as always. Their new
items are not even shadowed (nothing looks at them again while the list stays), so should another
list take its place, those items are sent again.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import operator
from typing import Any

import msgspec

from bridge_server.wire.codec import SCALAR_WRITERS, Encoder, FieldReader, field_reader
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["Patcher"]

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_INT_ONLY = {int}


# --- the sender -----------------------------------------------------------------------------------
# A record's fields and a list's items are shadowed as two parallel lists: `leaves`, the values
# themselves where they are simple immutable scalars (exact None, bool, int, float, str or bytes; and
# enum members), and `kids`, a shadow node for everything else (None for a scalar). The hot loop
# (`_diff_parts`) skips a part that `is` its leaf, compares and writes scalars in place, and calls a
# node only for containers and other kinds. Identity is trusted only for those immutable leaves.
# Shadow nodes: `diff` emits the ops that turn the previous encoding into obj's and returns obj's
# shadow (itself, updated in place, where it can); `same` says whether obj encodes exactly as the
# shadowed object did.

_NOT_A_LEAF = object()
_UNSET_TYPE = type(msgspec.UNSET)


class _Refit(Exception):
    """A part that a container's shadow cannot follow (a record's field now msgspec UNSET, which the
    encoder leaves out): the container is sent whole."""


# The ops a row carries (`PatchRow`), as the receiver tells them apart: by op, and for a set by the
# Value's kind.
_APPEND_STR, _APPEND_INTS, _SET_INT, _SET_FLOAT, _SET_STR = range(5)
_SET_CODES = {int: _SET_INT, float: _SET_FLOAT, str: _SET_STR}
_SIMPLE = frozenset({type(None), bool, int, float, str, bytes})
_WRITE = SCALAR_WRITERS


def _same_scalar(x: Any, old: Any) -> bool:
    """Whether x encodes as the simple scalar `old` does (exact type; -0.0 is not 0.0; a NaN is
    never the same, so it is re-sent: correct, and rare)."""
    cls = type(x)
    return cls is type(old) and x == old and (cls is not float or x != 0.0 or
                                              math.copysign(1.0, x) == math.copysign(1.0, old))


class _Node:
    __slots__ = ()

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        return False

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        if self.same(p, obj, depth, active):
            return self
        return p.whole(obj, path, depth, active)


class _Opaque(_Node):
    """Encoded as something never compared (a ref, a tensor, a set, a container subclass, a value
    past the depth limit): sent whole every time, as the full encoding would (refs included). Also
    the shadow of what is trusted by identity and so never shadowed (a growing list's items, a field
    declared constant): sent whole should another object take its place."""

    __slots__ = ()


_OPAQUE = _Opaque()


class _Leaf(_Node):
    """A simple scalar where no parts list holds it (a map's key or value, a stream's root)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        return obj is self.value or _same_scalar(obj, self.value)


class _Str(_Leaf):
    """A stream whose items are strings: they may grow."""

    __slots__ = ()

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        v = self.value
        if type(obj) is str and obj.startswith(v):
            if len(obj) > len(v):
                p.pend.append((tuple(path), _APPEND_STR, obj[len(v):]))
                self.value = obj
            return self
        return p.whole(obj, path, depth, active)


class _Enum(_Node):
    """An enum member: members are singletons, and their encoding depends on nothing else."""

    __slots__ = ("member",)

    def __init__(self, member: Any) -> None:
        self.member = member

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        return obj is self.member


def _all_ints(obj: list[Any]) -> bool:
    """Every item an exact int (a bool or a float equal to one is not), counted in C."""
    return operator.countOf(map(type, obj), int) == len(obj)


def _as_ints(obj: Any) -> bool:
    """Whether the encoder sends this (exact) list as packed `ints`: non-empty, every item an exact
    int, all within 64 bits (a bigger one makes it a list of Values)."""
    return bool(obj) and type(obj[0]) is int and set(map(type, obj)) == _INT_ONLY and \
        _I64_MIN <= min(obj) and max(obj) <= _I64_MAX


class _Ints(_Node):
    """A list sent as packed `ints`; the shadow is a copy of its values (the list itself may be
    appended to in place by its owner)."""

    __slots__ = ("values", "source")

    def __init__(self, values: list[int]) -> None:
        self.values = values
        self.source: Any = None     # for a growing field: the list shadowed (see the module's doc)

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        return type(obj) is list and obj == self.values and _all_ints(obj)

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        old = self.values
        n = len(old)
        if obj is self.source:       # a growing field, still its list: only the new items are new
            if len(obj) == n:
                return self
            if len(obj) == n + 1:        # one token more: the usual case
                x = obj[n]
                if type(x) is int and _I64_MIN <= x <= _I64_MAX:
                    p.pend.append((tuple(path), _APPEND_INTS, [x]))
                    old.append(x)
                    return self
            tail = obj[n:] if len(obj) > n else None
            if tail is not None and _all_ints(tail) and _I64_MIN <= min(tail) and max(tail) <= _I64_MAX:
                p.pend.append((tuple(path), _APPEND_INTS, tail))
                old.extend(tail)
                return self
            return p.whole(obj, path, depth, active)
        # Every item's type, not only the new ones': an equal int of another type (True, 1.0) in
        # place of an old one would encode differently. In C, and what the encoder checks anyway.
        if type(obj) is list and len(obj) >= n and obj[:n] == old and _all_ints(obj):
            if len(obj) == n:
                return self
            tail = obj[n:]
            if _I64_MIN <= min(tail) and max(tail) <= _I64_MAX:
                p.pend.append((tuple(path), _APPEND_INTS, tail))
                old.extend(tail)
                return self
        return p.whole(obj, path, depth, active)


def _diff_parts(p: Patcher, values: Any, leaves: list[Any], kids: list[_Node | None], path: list[int],
                depth: int, active: set[int], constant: frozenset[int] = frozenset(),
                grows: frozenset[int] = frozenset(), special: frozenset[int] = frozenset()) -> None:
    """Emits the ops for the parts (fields or items) in `values`, the first len(values) of those
    shadowed, and updates their shadow. `depth` is the parts' own. The parts at `constant` positions
    are a record's fields that its adapter declares to stay the same object through a stream (a
    request's prompt token ids): while they are that object they are not compared, which is what the
    full encoding assumes of them too (it sends its first encoding again); they are not shadowed
    either, so another object in their place is sent whole, as the full encoding encodes it anew.
    Those at `grows` positions are declared growing lists: their shadows learn which list they
    shadow. `special`: both."""
    pend = p.pend
    i = -1
    for x in values:
        i += 1
        old = leaves[i]
        if x is old:
            continue
        cls = type(x)
        if cls in _SIMPLE:
            if cls is type(old):
                if cls is str:
                    if x.startswith(old):
                        if len(x) > len(old):
                            pend.append(((*path, i), _APPEND_STR, x[len(old):]))
                        leaves[i] = x
                        continue
                elif x == old and (cls is not float or x != 0.0 or math.copysign(1.0, x) == math.copysign(1.0, old)):
                    leaves[i] = x
                    continue
            code = _SET_CODES.get(cls)
            if code is None or (cls is int and not _I64_MIN <= x <= _I64_MAX):
                _WRITE[cls](x, p.op(path + [i]).set)     # a kind no row carries
            else:
                pend.append(((*path, i), code, x))
            leaves[i] = x
            kids[i] = None
            continue
        if cls is _UNSET_TYPE:     # a record's field now unset: its fields are not those shadowed
            raise _Refit
        kid = kids[i]
        path.append(i)
        if kid is None:
            kid = p.whole(x, path, depth, active)
        else:
            new = kid.diff(p, x, path, depth, active)
            if new is kid and i not in special:     # the usual case: the same node, updated in place
                path.pop()
                continue
            kid = new
        path.pop()
        kids[i] = kid
        if i in grows and type(kid) in _GROWABLE:
            kid.source = x      # type: ignore[attr-defined]  # _Ints or _Seq
        leaves[i] = kid.member if type(kid) is _Enum else x if i in constant else _NOT_A_LEAF


def _same_parts(p: Patcher, owner: Any, values: Any, leaves: list[Any], kids: list[_Node | None], depth: int,
                active: set[int]) -> bool:
    """Whether `owner`'s parts (`values`) are those shadowed; `owner` is on the path meanwhile, so a
    cycle back to it is never followed."""
    active.add(id(owner))
    try:
        for x, old, kid in zip(values, leaves, kids):
            if x is old:
                continue
            if kid is None:
                if not _same_scalar(x, old):
                    return False
            elif not kid.same(p, x, depth, active):
                return False
        return True
    finally:
        active.discard(id(owner))


class _Seq(_Node):
    """A list (of values, not packed) or a tuple: its items' shadows in order."""

    __slots__ = ("changed", "cls", "kids", "leaves", "source")

    def __init__(self, cls: type, leaves: list[Any], kids: list[_Node | None]) -> None:
        self.cls = cls
        self.leaves = leaves
        self.kids = kids
        self.source: Any = None     # for a growing field: the list shadowed (see the module's doc)
        self.changed = False        # sent whole at the item before, in place of another one

    def _fits(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        """obj encodes as this kind (not packed ints, not a ref) and can be compared item by item."""
        cls = self.cls
        return depth < p.max_depth and id(obj) not in active and type(obj) is cls and not (
            cls is list and _as_ints(obj))

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        if not self._fits(p, obj, depth, active) or len(obj) != len(self.leaves):
            return False
        return _same_parts(p, obj, obj, self.leaves, self.kids, depth + 1, active)

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        leaves, kids = self.leaves, self.kids
        n = len(leaves)
        if not self._fits(p, obj, depth, active) or len(obj) < n:
            return _resend(self.changed, p, obj, path, depth, active)   # (a DELTA output's merged logprobs)
        # a list of the same length is compared item by item; one that grew without being the growing
        # field's list was not the last item's either: shorter at the next item, it churns
        self.changed = len(obj) > n and obj is not self.source
        active.add(id(obj))
        depth += 1
        if obj is not self.source:      # else a growing field, still its list: its items stay as they were
            try:
                _diff_parts(p, obj if len(obj) == n else itertools.islice(obj, n), leaves, kids, path, depth, active)
            except _Refit:
                active.discard(id(obj))
                return p.whole(obj, path, depth - 1, active)
        if len(obj) > n:
            added = p.op(path).append_items.items
            if obj is self.source:
                # Nothing compares a growing list's items while it is still the list (above), so its new
                # ones are encoded and not shadowed (a logprob dict per token cost as much to shadow as to
                # encode). Should another list take its place, each of them is sent again (`_OPAQUE`).
                for x in obj[n:]:
                    p.fill(x, added.add(), depth, active)
                    simple = type(x) in _SIMPLE
                    leaves.append(x if simple else _NOT_A_LEAF)
                    kids.append(None if simple else _OPAQUE)
            else:
                for x in obj[n:]:
                    p.fill(x, added.add(), depth, active)
                    p.add_part(x, leaves, kids, depth, active)
        active.discard(id(obj))
        return self


class _Map(_Node):
    """A dict: its entries' shadows in order. Changed maps are sent whole (no op walks into a map)."""

    __slots__ = ("changed", "entries")

    def __init__(self, entries: list[tuple[_Node, _Node]]) -> None:
        self.entries = entries
        self.changed = False      # sent whole at the item before, in place of another map

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        if self.same(p, obj, depth, active):
            self.changed = False
            return self
        return _resend(self.changed, p, obj, path, depth, active)

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        entries = self.entries
        if type(obj) is not dict or len(obj) != len(entries) or depth >= p.max_depth or id(obj) in active:
            return False
        active.add(id(obj))
        depth += 1
        try:
            return all(k.same(p, key, depth, active) and v.same(p, value, depth, active)
                       for (k, v), (key, value) in zip(entries, obj.items()))
        finally:
            active.discard(id(obj))


class _Churn(_Node):
    """What stands where a map was different at two items in a row (a DELTA generation's logprob
    dict, new at every token), or a list was sent whole at two items in a row (its logprob list,
    shorter than the last when vLLM merged waiting outputs): it is sent whole every time and never
    shadowed, as its shadow would only be found different again. Sending a value whole is never
    wrong; it only costs the bytes."""

    __slots__ = ()

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        p.fill(obj, p.op(path).set, depth, active)
        return self


_CHURN = _Churn()


def _resend(changed: bool, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
    """obj sent whole in place of a map or list whose shadow it did not fit: shadowed, and marked as
    sent whole in place of another (`changed`); or, when that shadow had been sent so itself
    (`changed`), without a shadow from then on (`_Churn`)."""
    if changed:
        return _CHURN.diff(p, obj, path, depth, active)
    node = p.whole(obj, path, depth, active)
    if type(node) is _Map or type(node) is _Seq:
        node.changed = True
    return node


class _Record(_Node):
    """A record: its class, its field names as encoded, and their values' shadows."""

    __slots__ = ("cls", "names", "leaves", "kids", "plan", "constant", "grows", "special")

    def __init__(self, cls: type, names: tuple[str, ...], leaves: list[Any], kids: list[_Node | None],
                 plan: FieldReader, constant: frozenset[int], grows: frozenset[int]) -> None:
        self.cls = cls
        self.names = names
        self.leaves = leaves
        self.kids = kids
        self.plan = plan
        self.constant = constant       # positions of fields declared constant (see `_diff_parts`)
        self.grows = grows             # positions of fields declared growing (the same)
        self.special = constant | grows

    def _fields(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> Any:
        """obj's field values, if obj encodes as a record with the same fields in the same order."""
        if type(obj) is not self.cls or depth >= p.max_depth or id(obj) in active:
            return None
        plan = self.plan
        if self.names is plan.names:      # the last item had every field: the fast way, if it still has
            values = plan.values(obj)
            if values is not None:
                return values
        fields = p.encoder.record_fields(obj)
        names = self.names
        if fields is None or len(fields) != len(names):
            return None
        for (name, _), known in zip(fields, names):
            if name != known:
                return None
        return [v for _, v in fields]

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        values = self._fields(p, obj, depth, active)
        if values is None:
            return False
        return _same_parts(p, obj, values, self.leaves, self.kids, depth + 1, active)

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        key = id(obj)
        plan = self.plan
        values = None
        get = plan.get
        if self.names is plan.names and type(obj) is self.cls and depth < p.max_depth and key not in active \
                and get is not None:
            # The usual case, inline: every field there, as last time. (`FieldReader.values` would also
            # look for a field that is now msgspec UNSET: `_diff_parts` finds one, among those that
            # changed, for less.)
            try:
                values = get(obj)
            except AttributeError:
                values = None
        if values is None:
            values = self._fields(p, obj, depth, active)
            if values is None:
                return p.whole(obj, path, depth, active)
        active.add(key)
        try:
            _diff_parts(p, values, self.leaves, self.kids, path, depth + 1, active, self.constant, self.grows,
                        self.special)
        except _Refit:
            active.discard(key)
            return p.whole(obj, path, depth, active)     # after the ops so far: this set replaces all they did
        active.discard(key)
        return self


class Patcher:
    """The sender's side of one stream: puts each item into a message (a `StreamItem` or a
    `MuxEvent`, both of which have `value` and `patch`) as a whole Value the first time and as a
    patch against the previous item after that; with `rows` (patch-v2), a patch whose ops change
    the same places in the same ways as the patch before it goes as their values only (a row).

    Why rows: each op is a protobuf message of its own, and building it (the op, its path, its
    Value) cost more than finding what changed. A generation's items change the same few places
    token after token (the text, the token ids, two stats), so most of its patches have the shape
    of the one before, and a row is one message of three packed lists."""

    __slots__ = ("encoder", "max_depth", "root", "ops", "pend", "rows", "shape")

    def __init__(self, encoder: Encoder, rows: bool = False) -> None:
        self.encoder = encoder
        self.max_depth = encoder.max_depth
        self.root: _Node | None = None
        self.ops: Any = None              # the patch being written, then its ops once it has any
        # The ops found and not yet written, in order, each (path, code, value): those of the kinds
        # a row carries (`_APPEND_STR` ... `_SET_STR`). Any other op writes them first, then itself.
        self.pend: list[tuple[tuple[int, ...], int, Any]] = []
        self.rows = rows
        self.shape: list[tuple[tuple[int, ...], int]] | None = None   # the last patch's, if a row could follow it

    def put(self, obj: object, msg: Any) -> None:
        root = self.root
        # Patches pay off for what has parts that stay (records, lists, strings); a number, a map or
        # a ref is simply sent again.
        if root is None or not isinstance(root, _PATCHED_ROOTS):
            self.encoder.encode_into(obj, msg.value)
            self.root = self.shadow(obj, 0, set())
            return
        patch = msg.patch
        patch.SetInParent()            # present even when nothing changed
        self.ops = patch
        pend = self.pend
        try:
            self.root = root.diff(self, obj, [], 0, set())
            if not self.rows or self.ops is not patch:     # no rows, or an op of another kind was written
                self.shape = None
                self.flush()
                return
            # nothing but the kinds a row carries: a row, if they are the last patch's ops; else ops,
            # and the next patch may be a row of these
            here = list(map(_SHAPE_OF, pend))
            row = None if self.shape is None else _as_row(pend, here, self.shape)
            if row is not None:
                _write_row(row, patch.row)
            else:
                self.shape = here or None
                self.flush()
        except BaseException:
            self.root = None           # the shadow may be half updated: never patch against it again
            self.shape = None
            raise
        finally:
            self.ops = None
            pend.clear()

    # -- what the shadows call ------------------------------------------------------------------
    def flush(self) -> None:
        """Writes the pending ops as ops."""
        ops = self.ops
        if type(ops) is not _OPS:         # the patch's ops, reached once a patch has any
            ops = self.ops = ops.ops
        for path, code, value in self.pend:
            op = ops.add()
            if path:
                op.path.extend(path)
            if code == _APPEND_STR:
                op.append_str = value
            elif code == _APPEND_INTS:
                op.append_ints.values.extend(value)
            elif code == _SET_INT:
                op.set.int = value
            elif code == _SET_FLOAT:
                op.set.float = value
            else:
                op.set.str = value
        self.pend.clear()

    def op(self, path: list[int]) -> Any:
        """A new op at `path`, for the caller to fill (after the pending ones: ops keep their order)."""
        self.flush()
        op = self.ops.add()
        if path:
            op.path.extend(path)
        return op

    def whole(self, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        """Sends obj whole at `path`, encoded exactly as the encoder would there."""
        self.fill(obj, self.op(path).set, depth, active)
        return self.shadow(obj, depth, active)

    def fill(self, obj: Any, out: pb.Value, depth: int, active: set[int]) -> None:
        self.encoder.encode_at(obj, out, depth, active)

    def add_part(self, x: Any, leaves: list[Any], kids: list[_Node | None], depth: int, active: set[int]) -> None:
        """Shadows one more part (a field, an item) at `depth`."""
        if type(x) in _SIMPLE:
            leaves.append(x)
            kids.append(None)
            return
        kid = self.shadow(x, depth, active)
        leaves.append(kid.member if type(kid) is _Enum else _NOT_A_LEAF)
        kids.append(kid)

    def _parts(self, owner: Any, values: Any, depth: int, active: set[int],
               constant: frozenset[int] = frozenset()) -> tuple[list[Any], list[_Node | None]]:
        """The shadows of `values`, `owner`'s parts. Those at `constant` positions (a record's fields
        declared constant) are compared by identity only (`_diff_parts`): they are their own leaf and
        are not shadowed (a request's prompt logprobs would cost the first item a shadow of every
        one of them)."""
        leaves: list[Any] = []
        kids: list[_Node | None] = []
        active.add(id(owner))
        try:
            if not constant:
                for x in values:
                    self.add_part(x, leaves, kids, depth + 1, active)
                return leaves, kids
            for i, x in enumerate(values):
                if i in constant and type(x) not in _SIMPLE and not isinstance(x, enum.Enum):
                    leaves.append(x)
                    kids.append(_OPAQUE)
                else:
                    self.add_part(x, leaves, kids, depth + 1, active)
        finally:
            active.discard(id(owner))
        return leaves, kids

    def shadow(self, obj: Any, depth: int, active: set[int]) -> _Node:
        """What obj was encoded as, to compare the next item with: mirrors `Encoder._fill`."""
        cls = type(obj)
        if cls is str:
            return _Str(obj)
        if cls in _SIMPLE:
            return _Leaf(obj)
        if cls is list:
            if _as_ints(obj):      # packed before any depth check, as the encoder does
                return _Ints(list(obj))
            if depth >= self.max_depth or id(obj) in active:
                return _OPAQUE
            return _Seq(list, *self._parts(obj, obj, depth, active))
        if cls is tuple:
            if depth >= self.max_depth or id(obj) in active:
                return _OPAQUE
            return _Seq(tuple, *self._parts(obj, obj, depth, active))
        if cls is dict:
            if depth >= self.max_depth or id(obj) in active:
                return _OPAQUE
            active.add(id(obj))
            entries = [(self.shadow(k, depth + 1, active), self.shadow(v, depth + 1, active)) for k, v in obj.items()]
            active.discard(id(obj))
            return _Map(entries)
        if cls in (set, frozenset, bytearray, memoryview):
            return _OPAQUE
        fields = self.encoder.record_fields(obj)
        if fields is None:
            return _Enum(obj) if issubclass(cls, enum.Enum) else _OPAQUE
        if depth >= self.max_depth or id(obj) in active:
            return _OPAQUE
        plan = field_reader(cls, self.encoder.records.get(cls))  # type: ignore[arg-type]  # classes hash
        names = tuple(n for n, _ in fields)
        if names == plan.names:
            names = plan.names        # the same tuple: `_Record._fields` then takes the fast way
        constant, grows = _marked(names, self.encoder.constant_fields.get(cls), self.encoder.growing_fields.get(cls))
        values = [v for _, v in fields]
        if _SIMPLE.issuperset(map(type, values)):    # scalars only (a logprob, stats): they are their own shadow
            scalars: list[_Node | None] = [None] * len(values)
            return _Record(cls, names, values, scalars, plan, constant, grows)
        leaves, kids = self._parts(obj, values, depth, active, constant)
        for i in grows:
            kid = kids[i]
            if type(kid) in _GROWABLE:
                kid.source = fields[i][1]     # type: ignore[union-attr]  # _Ints or _Seq
        return _Record(cls, names, leaves, kids, plan, constant, grows)


@functools.lru_cache(maxsize=1024)
def _marked(names: tuple[str, ...], constant: frozenset[str] | None,
            growing: frozenset[str] | None) -> tuple[frozenset[int], frozenset[int]]:
    """Which of a record's fields (by position) its class declares constant, and which growing:
    the same for every record of a shape, and worked out for each stream's first item."""
    return (frozenset(i for i, n in enumerate(names) if n in constant) if constant else frozenset(),
            frozenset(i for i, n in enumerate(names) if n in growing) if growing else frozenset())


def _as_row(pend: list[tuple[tuple[int, ...], int, Any]], here: list[tuple[tuple[int, ...], int]],
            shape: list[tuple[tuple[int, ...], int]]) -> list[tuple[tuple[int, ...], int, Any]] | None:
    """The pending ops (whose paths and codes are `here`) as the ops of `shape` (the last patch's),
    or None if they are not. An append that `shape` has and this patch lacks is an empty one: a
    token whose text is not yet complete (part of a character) adds token ids and no text, and it
    would otherwise break the run of rows twice."""
    if here == shape:
        return pend
    if len(pend) > len(shape):
        return None
    out = []
    j = 0
    for path, code in shape:
        if j < len(pend) and pend[j][0] == path and pend[j][1] == code:
            out.append(pend[j])
            j += 1
        elif code == _APPEND_STR:
            out.append((path, code, ""))
        elif code == _APPEND_INTS:
            out.append((path, code, ()))
        else:
            return None
    return out if j == len(pend) else None


def _write_row(pend: list[tuple[tuple[int, ...], int, Any]], row: Any) -> None:
    """The pending ops' values as a `PatchRow`: each kind's values in op order (an append_ints op
    as its count, then its values)."""
    strs: list[str] = []
    ints: list[int] = []
    floats: list[float] = []
    for _, code, value in pend:
        if code == _APPEND_STR or code == _SET_STR:
            strs.append(value)
        elif code == _APPEND_INTS:
            ints.append(len(value))
            ints.extend(value)
        elif code == _SET_INT:
            ints.append(value)
        else:
            floats.append(value)
    if strs:
        row.strs.extend(strs)
    if ints:
        row.ints.extend(ints)
    if floats:
        row.floats.extend(floats)


_PATCHED_ROOTS = (_Record, _Seq, _Ints, _Str)
_OPS = type(pb.StreamPatch().ops)
_SHAPE_OF = operator.itemgetter(0, 1)     # a pending op's path and code
_GROWABLE = (_Ints, _Seq)
