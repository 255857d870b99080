"""The typing rule every configuration key follows: text is never a number or a boolean, a
number never a boolean, a boolean never a number; a key that takes one of several types says in
one line what it takes (:func:`accepts`). The sections (:mod:`.schema`) apply it to every key."""

from __future__ import annotations

import types
import typing
from typing import Any


# ------------------------------------------------------------------ what a key's type takes
def members(annotation: Any) -> tuple[Any, ...]:
    """The alternatives of a union (``float | Literal['auto']``), ``None`` left out; else the type itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _takes(annotation: Any) -> tuple[set[str], tuple[Any, ...]]:
    """The kinds of scalar a key takes (``number``, ``bool``, ``text``: any text; ``other``: a
    mapping or a section, which this rule leaves alone) and its fixed choices (Literal members).
    A tuple takes what its elements take."""
    kinds: set[str] = set()
    choices: tuple[Any, ...] = ()
    for a in members(annotation):
        origin = typing.get_origin(a)
        if a is bool:
            kinds.add("bool")
        elif a in (int, float):
            kinds.add("number")
        elif a is str:
            kinds.add("text")
        elif origin is typing.Literal:
            choices += typing.get_args(a)
        elif origin is tuple:
            for element in typing.get_args(a):
                k, c = _takes(element)
                kinds |= k
                choices += c
        else:
            kinds.add("other")
    return kinds, choices


def _kind(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "text" if isinstance(value, str) else None


def _or(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def accepts(annotation: Any) -> str:
    """What a key of this type takes, in words: ``a number``, ``true or false``, ``a number or auto``."""
    words: list[str] = []
    for a in members(annotation):
        if a is bool:
            words.append("true or false")
        elif a is int:
            words.append("an integer")
        elif a is float:
            words.append("a number")
        elif a is str:
            words.append("text")
        elif typing.get_origin(a) is typing.Literal:
            words += [str(c) for c in typing.get_args(a)]
        elif typing.get_origin(a) is tuple:
            args = typing.get_args(a)
            what = "integers" if all(x is int for x in args) else "numbers" if all(x in (int, float) for x in args) else "values"
            words.append(f"a list of {len(args)} {what}")
        else:
            words.append("a mapping" if typing.get_origin(a) is dict else getattr(a, "__name__", str(a)))
    return _or(words)


def kind_problem(annotation: Any, value: Any) -> str | None:
    """One rule for every key: text is never a number or a boolean, a number never a boolean, a
    boolean never a number (pydantic would read ``"5"`` as 5, ``"yes"`` and ``1`` as true, ``true``
    as 1). A key's own text choices (``min_gain: auto``) are text it takes; YAML's true / false
    are the booleans. The problem in words, or None."""
    kinds, choices = _takes(annotation)
    numbers = "number" in kinds or any(_kind(c) == "number" for c in choices)
    texts = [c for c in choices if isinstance(c, str)]
    if "other" in kinds or not (numbers or "bool" in kinds):
        return None  # text keys and choices of words: pydantic's own message names what they take
    for x in value if isinstance(value, (list, tuple)) else [value]:
        kind = _kind(x)
        if kind == "bool" and "bool" not in kinds:
            return "a boolean is not a number; give a number"
        if kind == "number" and not numbers:
            return f"a number is not a boolean; give {accepts(annotation)}"
        if kind == "text" and "text" not in kinds and x not in texts:
            if texts and not _number_text(x):  # a word that is not one of the key's choices
                return f"expected {accepts(annotation)}"
            return f"text is not {'a number' if numbers else 'a boolean'}; give {accepts(annotation)} without quotes"
    return None


def _number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
