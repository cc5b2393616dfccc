"""Strict loading of plain YAML mappings into frozen dataclasses.

``build(cls, mapping, where)`` checks every key and value against the dataclass's fields:
an unknown key, a wrong type or a value outside what a field allows is a ``ConfigError``
that names the key path, the value and what is allowed. Fields declare extra rules with
``knob(default, check=..., allowed=...)``. Used for every ``params.yaml`` section and for
the sub-configs (dataset sources, caption templates) those sections contain.
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

from kohakumoss.errors import KohakuError


class ConfigError(KohakuError, ValueError):
    """A bad value in params.yaml; the message names the key, the value and the fix."""


def knob(default: Any = dataclasses.MISSING, *, check: Callable[[Any], bool] | None = None,
         allowed: str = "", help: str = "") -> Any:
    """A dataclass field with a validity rule (``check``) described by ``allowed``."""
    meta = {"check": check, "allowed": allowed, "help": help}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def fail(where: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{where} = {value!r} is not allowed: {allowed}")


# a number in scientific notation: YAML 1.1 (PyYAML) reads ``1e-4``, ``5E-5``, ``+1e-3`` and
# ``1.0e4`` (no dot, or no exponent sign) as strings, and ``dvc exp run -S optim.lr=1e-4``
# writes them that way
SCIENTIFIC = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)[eE][+-]?\d+", re.ASCII)


def _scientific(value: Any) -> decimal.Decimal | None:
    """The exact value of a string in scientific notation (a finite float), else None."""
    if isinstance(value, str) and SCIENTIFIC.fullmatch(value.strip()):
        number = decimal.Decimal(value.strip())
        if abs(number) <= decimal.Decimal(sys.float_info.max):
            return number
    return None


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def coerce(tp: Any, value: Any, where: str) -> Any:
    """Convert a YAML value to ``tp`` or raise a ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        for a in args:
            if value == a and type(value) is type(a):
                return a
        # YAML 1.1 (PyYAML) reads a bare on / off as a boolean: the choice it spells
        if isinstance(value, bool) and ("on" if value else "off") in args:
            return "on" if value else "off"
        fail(where, value, "one of " + ", ".join(repr(a) for a in args))
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(a, value, where)
            except ConfigError as e:
                errors.append(str(e).split(" is not allowed: ", 1)[-1])
        fail(where, value, " or ".join(errors))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return build(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        fail(where, value, "true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        number = _scientific(value)
        if number is not None and abs(number) < 2**63 and number == number.to_integral_value():
            return int(number)
        fail(where, value, "an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        number = _scientific(value)
        if number is not None:
            return float(number)
        fail(where, value, "a number")
    if tp is str:
        if isinstance(value, str):
            return value
        fail(where, value, "a string")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            fail(where, value, f"a list of {_type_name(args[0]) if args else 'values'}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            fail(where, value, f"a list of exactly {len(args)} values")
        return tuple(coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            fail(where, value, "a mapping")
        return dict(value)
    raise TypeError(f"configlib cannot coerce to {tp!r} ({where})")


def build(cls: type, mapping: Any, where: str) -> Any:
    """Strictly build dataclass ``cls`` from ``mapping`` (``None`` means all defaults)."""
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {mapping!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in mapping:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{where}.{key}: unknown key{hint} (allowed keys: {', '.join(fields)})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        path = f"{where}.{name}"
        if name not in mapping:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{path} is required and missing")
            continue
        value = coerce(hints[name], mapping[name], path)
        check = f.metadata.get("check")
        if check is not None and not check(value):
            fail(path, value, f.metadata.get("allowed") or "rejected by its check")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain JSON-able data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    return obj
