"""Dataclasses without generated code, for the classes that ``import streamer`` defines.

``dataclasses.dataclass`` compiles an ``__init__``, ``__eq__``, ``__hash__``, ``__repr__`` and,
frozen, a ``__setattr__`` and ``__delattr__`` for every class: ~0.8 ms for a class of 4 fields,
~2.3 ms for one of 25 (the configs), a third of ``import streamer`` after torch. ``record`` lets
``dataclasses`` collect the fields (so ``fields``, ``replace`` and ``asdict`` work) and gives the
class methods shared by every record, which read those fields: the same arguments, defaults,
factories, ``__post_init__``, comparison, hashing, repr and frozenness as ``dataclass(frozen=True)``
(or ``frozen=False``), for ~0.4 ms a class. Type checkers see a dataclass.

A record's subclass is a plain class or a ``@record``: ``dataclasses`` takes a record for a
mutable dataclass (telling it otherwise costs the generated methods back), so it refuses to make
a frozen dataclass of a subclass.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, overload

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # Python 3.10
    from typing_extensions import dataclass_transform

RecordClass = TypeVar("RecordClass", bound=type)

_MISSING: Any = dataclasses.MISSING


class _Field(NamedTuple):
    name: str
    init: bool
    default: Any
    factory: Any


class _Layout(NamedTuple):
    """What the shared methods need of a record class, worked out once when it is made."""

    fields: tuple[_Field, ...]
    init_names: tuple[str, ...]  # constructor arguments, in order
    compared: tuple[str, ...]
    hashed: tuple[str, ...]
    shown: tuple[str, ...]


class _Factory:
    def __repr__(self) -> str:
        return "<factory>"  # what dataclasses' own signatures show for a default_factory


_FACTORY = _Factory()


def _signature_of(cls: type) -> inspect.Signature:
    """The constructor's signature as ``dataclass`` would make it, for ``help`` and ``inspect``."""
    parameters = []
    for f in dataclasses.fields(cls):
        if f.init:
            default = f.default if f.default is not _MISSING else inspect.Parameter.empty
            if f.default_factory is not _MISSING:
                default = _FACTORY
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            parameters.append(inspect.Parameter(f.name, kind, default=default, annotation=f.type))
    return inspect.Signature(parameters, return_annotation=None)


def _layout_of(cls: type) -> _Layout:
    fields = dataclasses.fields(cls)
    return _Layout(
        fields=tuple(_Field(f.name, f.init, f.default, f.default_factory) for f in fields),
        init_names=tuple(f.name for f in fields if f.init),
        compared=tuple(f.name for f in fields if f.compare),
        hashed=tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash)),
        shown=tuple(f.name for f in fields if f.repr),
    )


def _layout(record: object) -> _Layout:
    layout: _Layout = type(record).__record_layout__  # type: ignore[attr-defined]
    return layout


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    cls, layout = type(self), _layout(self)
    if len(args) > len(layout.init_names):
        raise TypeError(f"{cls.__qualname__}() takes {len(layout.init_names)} arguments, {len(args)} given")
    given = dict(zip(layout.init_names, args, strict=False))
    for name, value in kwargs.items():
        if name in given:
            raise TypeError(f"{cls.__qualname__}() got multiple values for argument {name!r}")
        if name not in layout.init_names:
            raise TypeError(f"{cls.__qualname__}() got an unexpected keyword argument {name!r}")
        given[name] = value
    for field in layout.fields:
        if field.init and field.name in given:
            value = given[field.name]
        elif field.default is not _MISSING:
            value = field.default
        elif field.factory is not _MISSING:
            value = field.factory()
        elif field.init:
            raise TypeError(f"{cls.__qualname__}() missing required argument: {field.name!r}")
        else:
            continue  # init=False without a default: __post_init__ sets it
        object.__setattr__(self, field.name, value)
    post_init = getattr(self, "__post_init__", None)
    if post_init is not None:
        post_init()


def _values(self: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(getattr(self, name) for name in names)


def _eq(self: Any, other: object) -> Any:  # a bool, or NotImplemented for another class
    if other.__class__ is not self.__class__:
        return NotImplemented
    names = _layout(self).compared
    return _values(self, names) == _values(other, names)


def _hash(self: Any) -> int:
    return hash(_values(self, _layout(self).hashed))


def _repr(self: Any) -> str:
    shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in _layout(self).shown)
    return f"{type(self).__qualname__}({shown})"


def _refuse_setattr(self: Any, name: str, value: object) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _refuse_delattr(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _make(cls: RecordClass, frozen: bool) -> RecordClass:
    dataclasses.dataclass(init=False, repr=False, eq=False)(cls)
    methods: dict[str, Callable[..., Any] | None] = {"__init__": _init, "__eq__": _eq, "__repr__": _repr}
    # Frozen and compared: hashed by the compared fields; mutable and compared: unhashable.
    methods["__hash__"] = _hash if frozen else None
    if frozen:
        methods |= {"__setattr__": _refuse_setattr, "__delattr__": _refuse_delattr}
    for name, method in methods.items():
        if cls.__dict__.get(name) is None:  # a class's own method wins (__hash__ None: __eq__ alone)
            setattr(cls, name, method)
    cls.__record_layout__ = _layout_of(cls)  # type: ignore[attr-defined]
    cls.__signature__ = _signature_of(cls)  # type: ignore[attr-defined]
    return cls


@overload
def record(cls: RecordClass, /) -> RecordClass: ...
@overload
def record(*, frozen: bool = True) -> Callable[[RecordClass], RecordClass]: ...


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def record(
    cls: RecordClass | None = None, /, *, frozen: bool = True
) -> RecordClass | Callable[[RecordClass], RecordClass]:
    """``@record`` or ``@record(frozen=False)``: the class as ``dataclass(frozen=...)`` makes it."""
    if cls is None:
        return lambda cls: _make(cls, frozen)
    return _make(cls, frozen)
