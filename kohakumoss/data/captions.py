"""Caption templates: a row's tags / text / metadata -> one caption string
(``docs/data.md#captions``).

A template is a frozen dataclass of its options, registered in ``TEMPLATES`` by name and
loaded strictly from ``{"template": name, **options}`` with ``parse_template``. Each one
has ``render(row, rng)`` and ``estimate_chars(cols)``:

- ``render`` takes the row and a fresh generator; ``render_caption`` keys that generator by
  ``("caption", seed, row_id, variant)`` (``docs/data.md#seeding``), so variant ``v`` of a
  row is one fixed string and a row has at most ``caption.variants`` distinct captions
  (cacheable).
- ``estimate_chars`` is the vectorised upper bound of the rendered length from the
  catalog's per-row character columns (``COLUMNS``,
  ``docs/data.md#caption-length-estimates``), used to plan token budgets without rendering.

Text dropout (``docs/data.md#text-dropout``) is decided per batch slot by ``text_dropped``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Union

import numpy as np

from kohakumoss.configlib import ConfigError, build, knob
from kohakumoss.data.rows import Row, caption_char_counts, split_tags
from kohakumoss.seeding import rng_of

# Row fields a template may read, and the catalog character column each is counted in.
FIELD_COLUMNS = {"artist": "artist_chars", "rating": "rating_chars", "tags": "tags_chars",
                 "caption_nl": "nl_chars"}
# Column names in ``caption_char_counts`` order.
COLUMNS = ("tags_chars", "nl_chars", "artist_chars", "rating_chars", "json_chars")

_ESCAPED = re.compile(r"\\([()\[\]{}])")


# ---- tag utilities (docs/data.md#tag-utilities) ---------------------------------------

def unescape_tag(tag: str) -> str:
    r"""Drop the backslash of webui-escaped brackets: ``\(`` ``\)`` ``\[`` ``\]`` ``\{`` ``\}``."""
    return _ESCAPED.sub(r"\1", tag) if "\\" in tag else tag


def normalize_tag(tag: str, underscores: bool = True, unescape: bool = True) -> str:
    """``underscores``: '_' becomes ' '; ``unescape``: see ``unescape_tag``."""
    if underscores:
        tag = tag.replace("_", " ")
    return unescape_tag(tag) if unescape else tag


def field_values(row: Row, names: Sequence[str]) -> list[str]:
    """Values of row fields in order: a list field gives all its non-empty items, an empty
    or missing field gives nothing."""
    out: list[str] = []
    for name in names:
        value = getattr(row, name)
        if isinstance(value, (list, tuple)):
            out.extend(str(v) for v in value if v)
        elif value:
            out.append(str(value))
    return out


def _row_tags(row: Row) -> list[str]:
    return [t for t in (row.tags or ()) if t]


# ---- option checks ---------------------------------------------------------------------

def _prob(v: float) -> bool:
    return 0.0 <= v <= 1.0


def _row_fields(v: tuple[str, ...]) -> bool:
    return all(f in FIELD_COLUMNS for f in v)


_PROB = "a probability in [0, 1]"
_FIELDS = "a list of row fields from " + ", ".join(FIELD_COLUMNS)


def _col(cols: Mapping[str, Any], name: str) -> np.ndarray:
    return np.asarray(cols[name], dtype=np.int64)


def _max_joins(chars: np.ndarray) -> np.ndarray:
    """Most joints a tag list of ``chars`` characters (joined by ', ') can have:
    m non-empty tags need at least 3m - 2 characters."""
    return np.where(chars > 0, (chars - 1) // 3, 0)


# ---- templates (docs/data.md#templates) --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TagsTemplate:
    """Booru-style tags: fixed head, then groups with dropout and shuffling."""

    name: ClassVar[str] = "tags"
    template: str = dataclasses.field(default="tags", init=False)
    keep: tuple[str, ...] = knob(("artist",), check=_row_fields, allowed=_FIELDS)
    keep_first: int = knob(0, check=lambda v: v >= 0, allowed="an integer >= 0")
    keep_sep: str = "|||"
    group_sep: str = "%%"
    shuffle: bool = True
    tag_dropout: float = knob(0.0, check=_prob, allowed=_PROB)
    group_dropout: float = knob(0.0, check=_prob, allowed=_PROB)
    underscores: bool = True
    unescape: bool = True
    joiner: str = ", "
    prefix: str = ""
    suffix: str = ""

    def split(self, tags: list[str]) -> tuple[list[str], list[list[str]]]:
        """(fixed tags, groups of the rest); separator tags are never rendered."""
        fixed, rest = tags[:self.keep_first], tags[self.keep_first:]
        if self.keep_sep in rest:
            cut = rest.index(self.keep_sep)
            fixed, rest = fixed + rest[:cut], rest[cut + 1:]
        seps = (self.keep_sep, self.group_sep)
        fixed = [t for t in fixed if t not in seps]
        groups: list[list[str]] = [[]]
        for t in rest:
            if t == self.group_sep:
                groups.append([])
            elif t != self.keep_sep:
                groups[-1].append(t)
        return fixed, [g for g in groups if g]

    def render(self, row: Row, rng: np.random.Generator) -> str:
        fixed, groups = self.split(_row_tags(row))
        if self.group_dropout > 0:
            draws = rng.random(len(groups))
            groups = [g for g, d in zip(groups, draws) if d >= self.group_dropout]
        kept: list[list[str]] = []
        for group in groups:
            if self.tag_dropout > 0:
                draws = rng.random(len(group))
                group = [t for t, d in zip(group, draws) if d >= self.tag_dropout]
            if self.shuffle and len(group) >= 2:
                group = [group[i] for i in rng.permutation(len(group))]
            kept.append(group)
        if self.shuffle and len(kept) >= 2:
            kept = [kept[i] for i in rng.permutation(len(kept))]
        items = field_values(row, self.keep) + fixed + [t for g in kept for t in g]
        items = [normalize_tag(t, self.underscores, self.unescape) for t in items]
        return self.prefix + self.joiner.join(items) + self.suffix

    def estimate_chars(self, cols: Mapping[str, Any]) -> np.ndarray:
        """``docs/data.md#caption-length-estimates``; for a joiner longer than ', ' each
        possible joint adds the difference."""
        tags = _col(cols, "tags_chars")
        extra = max(len(self.joiner) - 2, 0)
        total = len(self.prefix) + len(self.suffix) + tags + extra * _max_joins(tags)
        for name in self.keep:
            c = _col(cols, FIELD_COLUMNS[name])
            total = total + np.where(c > 0, c + len(self.joiner), 0)
            if name == "tags":
                total = total + extra * _max_joins(c)
        return np.asarray(total, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class NlTemplate:
    """The natural-language caption, led by ``"<keep values>. "``; no caption -> fallback."""

    name: ClassVar[str] = "nl"
    template: str = dataclasses.field(default="nl", init=False)
    keep: tuple[str, ...] = knob((), check=_row_fields, allowed=_FIELDS)
    fallback: Template = TagsTemplate()

    def render(self, row: Row, rng: np.random.Generator) -> str:
        if not row.caption_nl:
            return self.fallback.render(row, rng)
        head = field_values(row, self.keep)
        return (", ".join(head) + ". " if head else "") + row.caption_nl

    def estimate_chars(self, cols: Mapping[str, Any]) -> np.ndarray:
        nl = _col(cols, "nl_chars")
        total = nl
        for name in self.keep:
            c = _col(cols, FIELD_COLUMNS[name])
            total = total + np.where(c > 0, c + 2, 0)
        return np.where(nl > 0, total, estimate_caption_chars(self.fallback, cols)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class MixTemplate:
    """Natural language with probability ``p_nl`` when the row has it, else tags."""

    name: ClassVar[str] = "mix"
    template: str = dataclasses.field(default="mix", init=False)
    p_nl: float = knob(0.5, check=_prob, allowed=_PROB)
    nl: Template = NlTemplate()
    tags: Template = TagsTemplate()

    def render(self, row: Row, rng: np.random.Generator) -> str:
        use_nl = bool(row.caption_nl) and self.p_nl > 0 and rng.random() < self.p_nl
        return (self.nl if use_nl else self.tags).render(row, rng)

    def estimate_chars(self, cols: Mapping[str, Any]) -> np.ndarray:
        return np.maximum(estimate_caption_chars(self.nl, cols),
                          estimate_caption_chars(self.tags, cols)).astype(np.int64)


def _line_value(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(v if isinstance(v, str) else _line_value(v) for v in value)
    if isinstance(value, dict):
        return _dump(value, sort_keys=True)
    return str(value)


def _dump(value: Any, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys,
                      default=str)


@dataclasses.dataclass(frozen=True)
class JsonTemplate:
    """The row's ``json`` metadata plus listed row fields, as ``key: value`` lines or JSON."""

    name: ClassVar[str] = "json"
    template: str = dataclasses.field(default="json", init=False)
    fields: tuple[str, ...] = knob(("artist", "rating", "tags", "caption_nl"),
                                   check=_row_fields, allowed=_FIELDS)
    style: Literal["lines", "json"] = "lines"
    order: tuple[str, ...] = ()
    field_dropout: float = knob(0.0, check=_prob, allowed=_PROB)
    keep: tuple[str, ...] = ()

    def data(self, row: Row, rng: np.random.Generator) -> dict[str, Any]:
        """The rendered mapping, keys in output order, after field dropout."""
        data = dict(row.json or {})
        for name in self.fields:
            value = _row_tags(row) if name == "tags" else getattr(row, name)
            if value and name not in data:
                data[name] = value
        first = [k for k in dict.fromkeys(self.order) if k in data]
        keys = first + sorted((k for k in data if k not in first), key=str)
        if self.field_dropout > 0:
            droppable = [k for k in keys if k not in self.keep]
            draws = rng.random(len(droppable))
            dropped = {k for k, d in zip(droppable, draws) if d < self.field_dropout}
            keys = [k for k in keys if k not in dropped]
        return {k: data[k] for k in keys}

    def render(self, row: Row, rng: np.random.Generator) -> str:
        data = self.data(row, rng)
        if self.style == "json":
            return _dump(data)
        return "\n".join(f"{k}: {_line_value(v)}" for k, v in data.items())

    def estimate_chars(self, cols: Mapping[str, Any]) -> np.ndarray:
        """``docs/data.md#caption-length-estimates`` for ``lines``. For ``json`` also the
        quotes, braces and commas the listed fields add (JSON string escapes in those fields
        are not counted)."""
        js = _col(cols, "json_chars")
        wrap = self.style == "json"
        total = np.where(js > 0, js, 2) if wrap else js
        for name in self.fields:
            c = _col(cols, FIELD_COLUMNS[name])
            if wrap:  # '"name":"value",' is 3 more than 'name: value\n'; a list 1 more per tag
                more = 4 + (c + 2) // 3 if name == "tags" else 3
            else:
                more = 0
            total = total + np.where(c > 0, c + len(name) + 3 + more, 0)
        return np.asarray(total, dtype=np.int64)


Template = Union[TagsTemplate, NlTemplate, MixTemplate, JsonTemplate]
TEMPLATES: dict[str, type] = {cls.name: cls for cls in (TagsTemplate, NlTemplate, MixTemplate,
                                                        JsonTemplate)}


def _nested(cls: type) -> dict[str, str]:
    """Option name -> default template name, for options that hold a template."""
    kinds = tuple(TEMPLATES.values())
    return {f.name: f.default.name for f in dataclasses.fields(cls) if isinstance(f.default, kinds)}


def parse_template(mapping: Any, where: str, default: str = "tags") -> Template:
    """Strictly build a template from ``{"template": name, **options}``.

    A missing ``template`` key means ``default`` (``tags`` at the top; a nested option's
    own default, e.g. ``nl`` for ``mix.nl``). A nested option set to null keeps its default.
    """
    if isinstance(mapping, tuple(TEMPLATES.values())):
        return mapping
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{where} must be a caption template mapping such as "
                          f"{{template: tags, tag_dropout: 0.1}}, got {mapping!r}")
    body = dict(mapping)
    name = body.pop("template", default)
    cls = TEMPLATES.get(name) if isinstance(name, str) else None
    if cls is None:
        near = difflib.get_close_matches(str(name), list(TEMPLATES), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"{where}.template = {name!r} is not a caption template{hint} "
                          f"(allowed: {', '.join(TEMPLATES)})")
    for key, sub_default in _nested(cls).items():
        if key in body:
            if body[key] is None:
                del body[key]
            else:
                body[key] = parse_template(body[key], f"{where}.{key}", sub_default)
    return build(cls, body, where)


# ---- rendering, estimates and dropout entry points ---------------------------------------------

def render_caption(template: Template, row: Row, seed: int, row_id: int, variant: int) -> str:
    """Caption ``variant`` of row ``row_id``: a fixed string per (seed, row, variant)."""
    return template.render(row, rng_of("caption", int(seed), int(row_id), int(variant)))


def estimate_caption_chars(template: Any, cols: Mapping[str, Any]) -> np.ndarray:
    """The template's upper-bound character estimate; without one, the sum of all columns."""
    if hasattr(template, "estimate_chars"):
        return template.estimate_chars(cols)
    return np.sum([_col(cols, c) for c in COLUMNS], axis=0).astype(np.int64)


def char_columns(rows: Sequence[Row]) -> dict[str, np.ndarray]:
    """The catalog's caption character columns for ``rows`` (int64 arrays)."""
    counts = np.array([caption_char_counts(r) for r in rows], dtype=np.int64)
    counts = counts.reshape(-1, len(COLUMNS))
    return {name: counts[:, i] for i, name in enumerate(COLUMNS)}


def estimate_text_tokens(chars: np.ndarray | int, chars_per_token: float = 3.5, overhead: int = 12,
                         max_tokens: int = 4096) -> Any:
    """min(ceil(chars / chars_per_token) + overhead, max_tokens), the division in float32.

    An array gives an int64 array; a scalar gives an ``np.int64``.
    """
    c = np.asarray(chars)
    tokens = np.ceil(c.astype(np.float32) / np.float32(chars_per_token)).astype(np.int64)
    out = np.minimum(tokens + overhead, max_tokens).astype(np.int64)
    return np.int64(out) if out.ndim == 0 else out


def text_dropped(seed: int, index: int, rank: int, slot: int, p: float) -> bool:
    """Whether slot ``slot`` of batch ``index`` on ``rank`` gets the empty prompt."""
    if p <= 0:
        return False
    if p >= 1:
        return True
    return bool(rng_of("text-drop", int(seed), int(index), int(rank), int(slot)).random() < p)


__all__ = [
    "COLUMNS", "FIELD_COLUMNS", "TEMPLATES", "JsonTemplate", "MixTemplate", "NlTemplate",
    "TagsTemplate", "Template", "char_columns", "estimate_caption_chars", "estimate_text_tokens",
    "field_values", "normalize_tag", "parse_template", "render_caption", "split_tags",
    "text_dropped", "unescape_tag",
]
