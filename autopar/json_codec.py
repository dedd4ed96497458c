"""Frozen dataclasses to JSON and back, read off their type hints: one codec for the plan file.

Where it sits: shared (autopar/), under autopar/plan.py, whose types inherit `JsonData`
and so get `to_json()` / `from_json()` with no hand-written pair; a field added to one
of them is written and read with no new code. Torch-free; imports nothing of the project.

Rules, by a field's type hint (what `to_json` writes, what `from_json` accepts):
- int, float, str, bool: the JSON value. An int field takes an integral number, a float
  field any number (held as a float); neither takes a bool; str and bool fields take only
  their JSON type.
- T | None: null, or T.
- tuple[T, ...] and tuple[A, B, ...]: a JSON array (of the stated length for the second).
- tuple[tuple[str, float], ...]: a breakdown, written as a JSON object {name: number};
  a nested object reads as "outer.inner" names; numbers are kept as written and the
  pairs sorted (an Estimate's nested breakdowns read straight in).
- tuple[tuple[str, Any], ...]: (name, value) pairs, written as a JSON object {name: value};
  the values as they are, the pairs sorted by name on read (an Estimate's config).
- a `JsonData` subclass: a JSON object with exactly its fields as keys (a field with a
  default may be absent: files written before it was added still load), or, when its
  JSON_ROW is True, an array of its fields in order (compact rows for long tables;
  trailing fields at their defaults are left out, so a row type can grow a field and
  the rows written before it still load, and are still written, as they were).
- any other dataclass with its own `from_json` (ParallelConfig): exactly its fields as
  keys, built by its `from_json` (so its own checks and messages apply); written by its
  `to_json`.
- Any: the JSON value as is.
A JSON value that breaks a rule raises `JsonFormatError` (a ValueError) naming where it
is ("plan.stages[1].num_layers") and what was expected; checks of meaning (does the
config fit the cluster) stay with the types' own `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from typing import Any, ClassVar, Mapping


class JsonFormatError(ValueError):
    """A JSON value of the wrong shape or type for its field; says where and what was expected."""


class JsonData:
    """Mixin of a frozen dataclass: `to_json()` and `from_json(data)` by the module's rules."""

    __slots__ = ()
    JSON_ROW: ClassVar[bool] = False
    """True: written as an array of the fields in order instead of an object."""

    def to_json(self) -> Any:
        return encode(self, type(self))

    @classmethod
    def from_json(cls, data: Any, where: str = "") -> Any:
        return decode(data, cls, where or cls.__name__)


_HINTS: dict[type, dict[str, Any]] = {}


def _fields(cls: type) -> list[tuple[str, Any]]:
    """(name, resolved type hint) of each dataclass field of `cls`, in order."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    hints = _HINTS[cls]
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _row_defaults(cls: type) -> list[Any]:
    """Each field's default (dataclasses.MISSING where it has none), in order."""
    return [f.default if f.default is not dataclasses.MISSING else
            (f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            for f in dataclasses.fields(cls)]


def _is_breakdown(hint: Any) -> bool:
    return (typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (...,)
            and typing.get_args(hint)[0] == tuple[str, float])


def _is_named_values(hint: Any) -> bool:
    return (typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (...,)
            and typing.get_args(hint)[0] == tuple[str, Any])


def encode(value: Any, hint: Any) -> Any:
    """The JSON form of `value`, whose type hint is `hint`."""
    if value is None:
        return None
    if isinstance(value, JsonData):
        items = [encode(getattr(value, name), h) for name, h in _fields(type(value))]
        if type(value).JSON_ROW:
            defaults = _row_defaults(type(value))
            names = [name for name, _ in _fields(type(value))]
            required = sum(d is dataclasses.MISSING for d in defaults)
            while len(items) > required and getattr(value, names[len(items) - 1]) == defaults[len(items) - 1]:
                items.pop()  # a trailing field at its default: rows written before it existed
            return items
        return {name: item for (name, _), item in zip(_fields(type(value)), items)}
    if dataclasses.is_dataclass(value):
        return value.to_json()
    if _is_breakdown(hint) or _is_named_values(hint):
        return dict(value)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return encode(value, inner)
    if origin is tuple:
        args = typing.get_args(hint)
        elements = [args[0]] * len(value) if args[1:] == (...,) else list(args)
        return [encode(v, h) for v, h in zip(value, elements)]
    return value


def _breakdown(data: Any, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(data, Mapping):
        raise JsonFormatError(f"malformed value at {where}: expected an object of numbers, got {_show(data)}")
    out: list[tuple[str, float]] = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.extend((f"{key}.{k}", v) for k, v in _breakdown(value, f"{where}.{key}"))
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise JsonFormatError(f"malformed value at {where}[{key!r}]: must be a number, got {_show(value)}")
        else:
            out.append((str(key), value))
    return tuple(sorted(out))


def _check_keys(data: Any, cls: type, where: str, *, defaults_optional: bool = False) -> None:
    if not isinstance(data, Mapping):
        raise JsonFormatError(f"{where} must be a JSON object, got {type(data).__name__}")
    expected = [f.name for f in dataclasses.fields(cls)]
    # a JsonData field added later with a default may be absent (files written before it load)
    optional = {f.name for f in dataclasses.fields(cls) if defaults_optional and (
        f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)}
    missing = sorted(set(expected) - set(data) - optional)
    unknown = sorted(set(data) - set(expected))
    if missing or unknown:
        parts = ([f"missing keys {missing}"] if missing else []) + ([f"unknown keys {unknown}"] if unknown else [])
        raise JsonFormatError(f"{where}: {' and '.join(parts)}; expected exactly {sorted(expected)}")


def _show(value: Any) -> str:
    return repr(value)[:80]


def decode(data: Any, hint: Any, where: str) -> Any:
    """The value of type `hint` that `data` (parsed JSON) stands for; `where` names it in errors."""
    if hint is Any:
        return data
    if isinstance(hint, type) and issubclass(hint, JsonData):
        fields = _fields(hint)
        if hint.JSON_ROW:
            required = sum(d is dataclasses.MISSING for d in _row_defaults(hint))
            if not isinstance(data, list) or not required <= len(data) <= len(fields):
                raise JsonFormatError(f"malformed value at {where}: expected an array "
                                      f"[{', '.join(n for n, _ in fields)}], got {_show(data)}")
            values = dict(zip((n for n, _ in fields), data))
        else:
            _check_keys(data, hint, where, defaults_optional=True)
            values = dict(data)
        return hint(**{name: decode(values[name], h, f"{where}.{name}") for name, h in fields if name in values})
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        _check_keys(data, hint, where)
        return hint.from_json(dict(data))  # type: ignore[attr-defined]
    if _is_breakdown(hint):
        return _breakdown(data, where)
    if _is_named_values(hint):
        if not isinstance(data, Mapping):
            raise JsonFormatError(f"malformed value at {where}: expected an object, got {_show(data)}")
        return tuple(sorted((str(key), value) for key, value in data.items()))
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if data is None else decode(data, inner, where)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(data, list) or (args[1:] != (...,) and len(data) != len(args)):
            raise JsonFormatError(f"malformed value at {where}: expected an array"
                                  + ("" if args[1:] == (...,) else f" of {len(args)}") + f", got {_show(data)}")
        elements = [args[0]] * len(data) if args[1:] == (...,) else list(args)
        return tuple(decode(v, h, f"{where}[{i}]") for i, (v, h) in enumerate(zip(data, elements)))
    if hint is bool or hint is str:
        if not isinstance(data, hint):
            raise JsonFormatError(f"malformed value at {where}: expected a {'boolean' if hint is bool else 'string'}, "
                                  f"got {_show(data)}")
        return data
    if hint is int:
        if isinstance(data, bool) or not isinstance(data, numbers.Real) or (
                isinstance(data, float) and not data.is_integer()):
            raise JsonFormatError(f"malformed value at {where}: expected an integer, got {_show(data)}")
        return int(data)
    if hint is float:
        if isinstance(data, bool) or not isinstance(data, numbers.Real):
            raise JsonFormatError(f"malformed value at {where}: expected a number, got {_show(data)}")
        return float(data)
    raise TypeError(f"json_codec has no rule for the type {hint!r} of {where}")
