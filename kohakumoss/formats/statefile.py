"""A nested training state as plain data: every tensor in one flat dict (for a
``.safetensors`` file), everything else as JSON that names those tensors. No pickle.

``flatten_state(obj) -> (tensors, tree)`` and ``unflatten_state(tree, tensors) -> obj`` are
exact inverses for what optimiser, LR-scheduler, EMA and RNG states are made of:

- ``None``, ``bool``, ``int``, ``str`` and finite ``float``: JSON values as they are;
- ``float('inf')``, ``-inf``, ``nan``: ``{"$float": "inf"}`` (strict JSON has no such number);
- ``list``: a JSON array; ``tuple``: ``{"$tuple": [...]}``;
- ``dict`` with ``str`` keys (none starting with ``$``): a JSON object, in order; any other
  dict (``int`` keys, as in an optimiser's per-parameter state): ``{"$dict": [[k, v], ...]}``;
- a tensor (any dtype and shape, 0-dim included): ``{"$tensor": name}``, the tensor stored
  under ``name`` (its path in the state, ``optimizer/state/0/exp_avg``) on the CPU.

So dtype, shape and values of every tensor, ``int`` vs ``str`` keys, key order and tuple vs
list come back as they were. Tensors come back as plain CPU tensors, each with its own
memory (two entries that shared memory are saved as two copies). Any other type is an
error naming its path, so nothing is silently turned into something else.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

TAGS = ("$float", "$tuple", "$dict", "$tensor")


def flatten_state(obj: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """``(tensors, tree)``: the tensors of ``obj`` by name and a JSON-able tree naming them."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple[str, int]] = set()

    def walk(x: Any, path: tuple[str, ...]) -> Any:
        kind = type(x)
        if x is None or kind in (bool, int, str):
            return x
        if kind is float:
            return x if math.isfinite(x) else {"$float": repr(x)}
        if kind is list:
            return [walk(v, path + (str(i),)) for i, v in enumerate(x)]
        if kind is tuple:
            return {"$tuple": [walk(v, path + (str(i),)) for i, v in enumerate(x)]}
        if kind is dict:
            for k in x:
                if type(k) not in (int, str):
                    raise TypeError(f"state key {k!r} at {_where(path)} is a {type(k).__name__}; "
                                    f"only int and str keys can be saved")
            items = [(k, walk(v, path + (str(k),))) for k, v in x.items()]
            if all(type(k) is str and not k.startswith("$") for k in x):
                return dict(items)
            return {"$dict": [[k, v] for k, v in items]}
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            where = (t.device.type, t.untyped_storage().data_ptr())
            if where in storages and t.numel():
                t = t.clone()  # safetensors refuses two names over one memory
            storages.add(where)
            name = "/".join(path) or "tensor"
            if name in tensors:  # only when keys themselves hold "/"
                name = f"{name}#{len(tensors)}"
            tensors[name] = t
            return {"$tensor": name}
        raise TypeError(f"cannot save a {kind.__name__} at {_where(path)}: a state may hold "
                        f"dicts, lists, tuples, tensors, floats, ints, bools, strings and None")

    return tensors, walk(obj, ())


def unflatten_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The object ``flatten_state`` was given, from its ``tree`` and ``tensors``."""

    def walk(x: Any) -> Any:
        if isinstance(x, list):
            return [walk(v) for v in x]
        if not isinstance(x, dict):
            return x
        tag = next(iter(x), None) if len(x) == 1 else None
        if tag not in TAGS:
            return {k: walk(v) for k, v in x.items()}
        value = x[tag]
        if tag == "$float":
            if value not in ("inf", "-inf", "nan"):
                raise ValueError(f"unknown float {value!r} in a saved state")
            return float(value)
        if tag == "$tuple":
            return tuple(walk(v) for v in value)
        if tag == "$dict":
            return {k: walk(v) for k, v in value}
        if value not in tensors:
            raise ValueError(f"the saved state names tensor {value!r}, which its tensor file "
                             f"does not hold")
        return tensors[value]

    return walk(tree)


def dumps_state(tree: Any) -> str:
    """The tree as strict JSON text (no NaN / Infinity tokens; key order kept)."""
    return json.dumps(tree, indent=1, allow_nan=False, ensure_ascii=False) + "\n"


def loads_state(text: str | bytes) -> Any:
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not strict JSON")

    return json.loads(text, parse_constant=no_constant)


def _where(path: tuple[str, ...]) -> str:
    return "/".join(path) or "the top level"
