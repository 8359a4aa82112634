"""``streamer.records.record`` behaves as ``dataclasses.dataclass`` does: the same class body
decorated both ways gives the same constructor, defaults, comparisons, hashes, reprs, errors and
``dataclasses`` helpers."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import field
from typing import Any

import pytest

from streamer.records import record

Decorator = Callable[[type], Any]


def _pair(frozen: bool = True) -> list[tuple[str, Decorator]]:
    return [("dataclass", dataclasses.dataclass(frozen=frozen)), ("record", record(frozen=frozen))]


def _made(decorate: Decorator) -> Any:
    """One class body with every kind of field: required, default, factory, hash=False,
    compare=False, repr=False, init=False set by __post_init__."""

    @decorate
    class Point:
        x: int
        y: int = 2
        tags: tuple[str, ...] = field(default_factory=lambda: ("a",))
        note: dict[str, int] = field(default_factory=dict, hash=False)
        label: str = field(default="p", compare=False)
        secret: str = field(default="s", repr=False)
        total: int = field(init=False, repr=False, compare=False)

        def __post_init__(self) -> None:
            object.__setattr__(self, "total", self.x + self.y)

    return Point


def _outcome(make: Callable[[], Any]) -> tuple[str, str]:
    """What building something gives: its repr, or the exception's type and message without the
    class's qualified name (which differs between the two decorations' local classes)."""
    try:
        return ("value", repr(make()).split("(", 1)[1])
    except Exception as error:  # the error is what is compared
        return (type(error).__name__, str(error).replace("_made.<locals>.Point", "Point"))


CONSTRUCTIONS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((1,), {}),
    ((1, 5), {}),
    ((), {"x": 1, "y": 3, "label": "q", "secret": "t"}),
    ((1,), {"tags": ("b",), "note": {"n": 1}}),
    ((), {}),  # x missing
    ((1,), {"x": 2}),  # x twice
    ((1,), {"z": 2}),  # no such argument
    ((1,), {"total": 3}),  # init=False
]


@pytest.mark.parametrize(("args", "kwargs"), CONSTRUCTIONS)
def test_construction_matches_dataclass(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    outcomes = {name: _outcome(lambda d=decorate: _made(d)(*args, **kwargs)) for name, decorate in _pair()}
    expected, got = outcomes["dataclass"], outcomes["record"]
    assert got[0] == expected[0]
    if got[0] == "value":
        assert got == expected


def test_too_many_positional_arguments_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="takes 6 arguments, 7 given"):
        _made(record)(1, 2, [], {}, "l", "s", 9)


@pytest.mark.parametrize(("name", "decorate"), _pair())
def test_equality_hash_and_frozenness(name: str, decorate: Decorator) -> None:
    point = _made(decorate)
    a, b = point(1, label="one"), point(1, label="two")
    assert a == b and hash(a) == hash(b)  # label is not compared
    noted = point(1, note={"k": 1})
    assert noted != a and hash(noted) == hash(a)  # note is compared, not hashed
    assert a != point(2) and a != (1, 2)
    assert a.total == 3 and point(1).note is not point(1).note  # each instance its own dict
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.x = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        del a.y
    assert repr(a).endswith("Point(x=1, y=2, tags=('a',), note={}, label='one')")


@pytest.mark.parametrize(("name", "decorate"), _pair())
def test_dataclass_helpers_copy_and_pickle(name: str, decorate: Decorator) -> None:
    point = _made(decorate)
    a = point(1, tags=("t",))
    assert [f.name for f in dataclasses.fields(a)] == ["x", "y", "tags", "note", "label", "secret", "total"]
    moved = dataclasses.replace(a, y=10)
    assert (moved.x, moved.y, moved.tags, moved.total) == (1, 10, ("t",), 11)
    assert dataclasses.asdict(a)["tags"] == ("t",) and dataclasses.is_dataclass(a)
    assert copy.deepcopy(a) == a and copy.copy(a) == a
    globals()["Point"] = point  # pickle finds a class by its module and qualified name
    point.__qualname__ = "Point"
    try:
        assert pickle.loads(pickle.dumps(a)) == a
    finally:
        del globals()["Point"]


@pytest.mark.parametrize(("name", "decorate"), _pair(frozen=False))
def test_a_mutable_record_assigns_and_is_unhashable(name: str, decorate: Decorator) -> None:
    @decorate
    class Counter:
        n: int = 0
        seen: list[int] = field(default_factory=list)

    c = Counter()
    c.n += 1
    c.seen.append(1)
    assert c == Counter(1, [1]) and Counter().seen is not Counter().seen
    with pytest.raises(TypeError, match="unhashable"):
        hash(c)


def test_a_class_keeps_its_own_methods() -> None:
    @record
    class Masked:
        key: str

        def __repr__(self) -> str:
            return "Masked(key=***)"

        def __hash__(self) -> int:
            return 7

    assert repr(Masked("k")) == "Masked(key=***)" and hash(Masked("k")) == 7
    assert Masked("k") == Masked("k") != Masked("j")


def test_every_dataclass_that_import_streamer_defines_is_a_record() -> None:
    """A dataclass defined while ``import streamer`` runs costs every process ~1-2 ms of generated
    code; the classes the import needs are records (the others are made when their module is)."""
    script = """
import dataclasses, inspect, sys
import streamer
slow = []
for name, module in list(sys.modules.items()):
    if name == "streamer" or name.startswith("streamer."):
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == name and dataclasses.is_dataclass(value) \\
                    and "__record_layout__" not in vars(value):
                slow.append(f"{name}.{value.__qualname__}")
print(" ".join(slow))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []


def test_a_subclass_of_a_record_is_a_plain_class_or_a_record() -> None:
    @record
    class Base:
        x: int = 1

    class Plain(Base):
        pass

    @record
    class Extended(Base):
        y: int = 2

    assert Plain(3).x == 3 and dataclasses.replace(Plain(3), x=4) == Plain(4)
    assert repr(Extended(y=5)).endswith("Extended(x=1, y=5)") and Extended(1, 2) == Extended()
    with pytest.raises(TypeError, match="cannot inherit frozen dataclass from a non-frozen one"):
        dataclasses.dataclass(frozen=True)(type("Frozen", (Base,), {}))


def test_the_constructor_signature_is_the_dataclass_one() -> None:
    """What ``help`` and ``inspect`` show of a record's constructor."""
    made = {name: _made(decorate) for name, decorate in _pair()}
    shown = {name: str(inspect.signature(cls)) for name, cls in made.items()}
    assert shown["record"] == shown["dataclass"]
    assert shown["record"].startswith("(x: 'int', y: 'int' = 2, tags: 'tuple[str, ...]' = <factory>")
