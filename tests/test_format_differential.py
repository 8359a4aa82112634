"""Differential fuzz: streamer.load_file against safetensors.torch.load_file on thousands of files.

Cases are mutations of a few valid files (length prefix, header bytes, JSON structure, file
length), generated from a fixed seed. Each file is loaded by both libraries in a worker process
(``format_differential_worker.py``; a crash or hang there fails that case, named). The verdicts:
both accept -> the same tensors, bit for bit; safetensors refuses -> streamer refuses with a
``StreamerError`` naming the file; safetensors accepts and streamer refuses -> only where the
case is one of ``DOCUMENTED_DIFFERENCES``; never a raw exception, crash or hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import struct
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import safetensors.torch
import torch

import streamer
from streamer.format.safetensors import MAX_HEADER_BYTES

SEED = 20261123
CASES = 4000  # distinct files, the valid bases and the issue's own cases included
CASE_TIMEOUT_S = 120.0  # a hang guard only: a case normally takes milliseconds
WORKER = Path(__file__).with_name("format_differential_worker.py")


def has_duplicate_key(content: bytes) -> bool:
    """Whether the header's JSON repeats a key in some object (read independently of streamer)."""
    found = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal found
        found = found or len({key for key, _ in items}) != len(items)
        return dict(items)

    try:
        n = struct.unpack("<Q", content[:8])[0]
        json.loads(content[8 : 8 + n].decode("utf-8"), object_pairs_hook=pairs)
    except (ValueError, RecursionError, struct.error):
        return False
    return found


# Where streamer refuses a file that safetensors loads, on purpose. Each: the test that the case is
# one, and what streamer's message must then say. Documented in the README's format table.
DOCUMENTED_DIFFERENCES: dict[str, tuple[Callable[[bytes], bool], tuple[str, ...]]] = {
    # safetensors keeps the last of two equal tensor names or metadata keys and ignores repeated
    # unknown fields; a repeated key makes a file ambiguous, so streamer refuses it.
    "duplicate JSON key": (has_duplicate_key, ("appears more than once", "twice")),
}


# --- valid base files ------------------------------------------------------------------------

SAFETENSORS_DTYPES = [
    *("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "C64", "U64", "U32", "U16"),
    *("F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"),
]
BITS = {"F64": 64, "C64": 64, "I64": 64, "U64": 64, "F32": 32, "I32": 32, "U32": 32, "F16": 16, "BF16": 16}
BITS |= {"I16": 16, "U16": 16, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}  # the rest are 8 bits


def nbytes(dtype: str, shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * BITS.get(dtype, 8) // 8


@dataclass(frozen=True)
class Base:
    """A valid file: its header document (tensors in data order), its data section, its padding."""

    doc: dict[str, Any]
    data: bytes
    padding: bytes = b""

    def content(self) -> bytes:
        return assemble(json.dumps(self.doc).encode() + self.padding, self.data)


def assemble(header: bytes, data: bytes, *, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def base(rng: random.Random, tensors: list[tuple[str, str, list[int]]], metadata: Any = None) -> Base:
    doc: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    data = bytearray()
    for name, dtype, shape in tensors:
        size = nbytes(dtype, shape)
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + size]}
        data += bytes(rng.randrange(2) for _ in range(size)) if dtype == "BOOL" else rng.randbytes(size)
    pad = b" " * (-(8 + len(json.dumps(doc))) % 8)  # as safetensors aligns the data section
    return Base(doc, bytes(data), pad)


def written_by_safetensors(directory: Path) -> Base:
    """A file the real writer made (its key order, its padding), read back as a Base."""
    g = torch.Generator().manual_seed(SEED)
    tensors = {
        "w": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "b": torch.randint(-128, 127, (5,), dtype=torch.int8, generator=g),
        "s": torch.tensor(2.5, dtype=torch.float64),
        "e": torch.empty(0, 2, dtype=torch.float16),
    }
    path = directory / "written.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    content = path.read_bytes()
    n = struct.unpack("<Q", content[:8])[0]
    text = content[8 : 8 + n].decode()
    stripped = text.rstrip(" ")
    return Base(json.loads(text), content[8 + n :], (len(text) - len(stripped)) * b" ")


def bases(rng: random.Random, directory: Path) -> list[Base]:
    mixed = [
        ("empty.first", "F16", [0, 3]),
        ("embed.weight", "BF16", [4, 3]),
        ("norm", "F32", [5]),
        ("scale", "F64", []),
        ("ids", "I64", [2]),
        ("empty.middle", "U8", [3, 0, 2]),
        ("mask", "BOOL", [7]),
        ("fp8", "F8_E4M3", [3, 2]),
        ("fp8b", "F8_E5M2FNUZ", [2]),
        ("e8m0", "F8_E8M0", [4]),
        ("fp4", "F4", [3, 4]),
        ("complex", "C64", [2]),
        ("u16", "U16", [3]),
        ("u64", "U64", [1]),
        ("i8", "I8", [1, 1, 3]),
        ("ünï.cødé", "I16", [2]),
        ("empty.last", "F32", [0]),
    ]
    return [
        base(rng, mixed, {"format": "pt", "note": "ünïcødé ✓"}),
        base(rng, [("w", "F32", [3, 4])]),
        base(rng, [("x", "U8", [1])]),
        base(rng, [], {"only": "metadata"}),
        base(rng, [("a", "F16", [0]), ("b", "I32", [2, 0])]),
        base(rng, [("q", "F4", [2, 6]), ("s", "F8_E8M0", [2]), ("t", "BF16", [1])]),
        written_by_safetensors(directory),
    ]


# --- mutations -------------------------------------------------------------------------------

BYTES = [b" ", b"\t", b"\n", b"\r", b"\x00", b"\x0b", b"\x0c", b"\xc2\xa0", b"\xef\xbb\xbf", b"\xff", b"\x80"]
TOKENS = [b'"', b"{", b"}", b"[", b"]", b",", b":", b"-", b"0", b"-0", b"1", b"1e3", b"1.0", b"true", b"null"]
TOKENS += [b'"__metadata__"', b'"dtype"', b'"shape"', b'"data_offsets"', b'"F4"', b'"\\ud800"', b"NaN"]
TOKENS += [b"18446744073709551616", b"9223372036854775808", b"1e400", b'"\\u0000"', b"\\"]
BIG = [2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, 2**62]
STRANGE = [-1, 1.0, "2", True, None, [], {}, *BIG]
NEG_ZERO, HUGE_FLOAT = "@@-0@@", "@@1e400@@"  # literals json.dumps cannot write


def dump(doc: Any, rng: random.Random) -> bytes:
    """JSON text in one of several legal spellings (separators, indentation, escapes)."""
    style = rng.randrange(4)
    if style == 0:
        text = json.dumps(doc)
    elif style == 1:
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    elif style == 2:
        text = json.dumps(doc, indent=rng.choice([1, "\t"]))
    else:
        text = json.dumps(doc, separators=(" ,", " : "))
    text = text.replace(f'"{NEG_ZERO}"', "-0").replace(f'"{HUGE_FLOAT}"', "1e400")
    return text.encode("utf-8", "surrogatepass")


def tensor_names(doc: dict[str, Any]) -> list[str]:
    return [name for name in doc if name != "__metadata__"]


def edit_offsets(rng: random.Random, doc: dict[str, Any], data: bytes) -> tuple[dict[str, Any], bytes]:
    names = tensor_names(doc)
    if not names:
        doc["x"] = {"dtype": "U8", "shape": [0], "data_offsets": [rng.choice([0, 1, len(data)]), 0]}
        return doc, data
    entry = doc[rng.choice(names)]
    begin, end = entry["data_offsets"]
    kind = rng.randrange(9)
    if kind == 0:
        entry["data_offsets"][rng.randrange(2)] += rng.choice([-8, -2, -1, 1, 2, 8])
    elif kind == 1:
        delta = rng.choice([-1, 1, 8])
        entry["data_offsets"] = [begin + delta, end + delta]
    elif kind == 2 and len(names) > 1:  # swap with another tensor
        other = doc[rng.choice([n for n in names if doc[n] is not entry])]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
    elif kind == 3 and len(names) > 1:  # make it overlap, or coincide with, another one
        other = doc[rng.choice([n for n in names if doc[n] is not entry])]
        entry["data_offsets"] = list(other["data_offsets"])
    elif kind == 4:  # every tensor shifted: a gap at the start, with or without the bytes for it
        shift = rng.choice([1, 8])
        for name in names:
            doc[name]["data_offsets"] = [x + shift for x in doc[name]["data_offsets"]]
        if rng.random() < 0.5:
            data = bytes(shift) + data
    elif kind == 5:
        entry["data_offsets"][rng.randrange(2)] = rng.choice(STRANGE)
    elif kind == 6:
        entry["data_offsets"] = rng.choice(
            [[begin], [begin, end, end], [], None, {"0": begin}, [NEG_ZERO, end]]
        )
    elif kind == 7:  # a zero-size tensor moved to some boundary or inside a tensor
        entry["shape"] = [0]
        entry["data_offsets"] = [where := rng.randrange(len(data) + 2), where]
    else:
        entry["data_offsets"] = [0, len(data)]
    return doc, data


def edit_dtype(rng: random.Random, doc: dict[str, Any]) -> dict[str, Any]:
    names = tensor_names(doc)
    if names:
        choices: list[Any] = [*SAFETENSORS_DTYPES, "E8M0", "f32", "F128", "", 5, None, ["F32"]]
        choices += [{"U8": None}, {"F32": None}, {"U8": 1}, {"U8": None, "I8": None}]
        doc[rng.choice(names)]["dtype"] = rng.choice(choices)
    return doc


def edit_shape(rng: random.Random, doc: dict[str, Any]) -> dict[str, Any]:
    names = tensor_names(doc)
    if not names:
        return doc
    entry = doc[rng.choice(names)]
    shape = entry["shape"]
    kind = rng.randrange(7)
    if kind == 0 and shape:
        shape[rng.randrange(len(shape))] += rng.choice([-1, 1])
    elif kind == 1:
        shape.insert(rng.randrange(len(shape) + 1), rng.choice([0, 1, 1, 2]))
    elif kind == 2 and shape:
        shape.pop(rng.randrange(len(shape)))
    elif kind == 3 and shape:
        shape[rng.randrange(len(shape))] = rng.choice([*STRANGE, NEG_ZERO, HUGE_FLOAT])
    elif kind in (4, 5):  # a zero-size tensor with huge dimensions, where it stands
        zero_at = rng.randrange(3)
        dims = [rng.choice(BIG), rng.choice([1, 4, *BIG])]
        dims.insert(zero_at, 0)
        entry["shape"] = dims
        entry["data_offsets"] = [entry["data_offsets"][0]] * 2
    else:
        entry["shape"] = rng.choice([None, 3, "[]", {}, [[1]]])
    return doc


def edit_names(rng: random.Random, doc: dict[str, Any]) -> tuple[dict[str, Any], bytes | None]:
    """Renames a tensor, or returns header text with a key repeated (which a dict cannot hold)."""
    names = tensor_names(doc)
    if not names:
        return doc, None
    name = rng.choice(names)
    kind = rng.randrange(3)
    if kind == 0:
        new = rng.choice(["", "__metadata__", "\ud800", "\udfff", "\U0001f600", "\x00", "a\nb", "__x__", " "])
        return {(new if key == name else key): value for key, value in doc.items()}, None
    text = json.dumps(doc)
    if kind == 1:  # a tensor name twice
        entry = json.dumps(doc[rng.choice(names)])
        return doc, (text[:-1] + f", {json.dumps(name)}: {entry}}}").encode()
    field = rng.choice(["dtype", "shape", "data_offsets", "extra"])  # a field twice
    value = json.dumps(doc[name].get(field, 1))
    doc[name]["dup@@"] = None
    return doc, json.dumps(doc).replace('"dup@@": null', f'"{field}": {value}').encode()


def edit_metadata(rng: random.Random, doc: dict[str, Any]) -> tuple[dict[str, Any], bytes | None]:
    kind = rng.randrange(4)
    if kind == 0:
        doc.pop("__metadata__", None)
    elif kind == 1:
        doc["__metadata__"] = rng.choice([None, {}, {"a": 1}, {"a": {}}, {"a": None}, [], "x", {"": ""}])
    elif kind == 2:
        doc["__metadata__"] = {"k": "v", "surrogate": rng.choice(["\ud800", "ok", "\U0001f600"])}
    else:
        doc["__metadata__"] = {"k": "1", "dup@@": None}
        text = json.dumps(doc).replace('"dup@@": null', rng.choice(['"k": "2"', '"k": 2']))
        return doc, text.encode()
    return doc, None


def edit_entry(rng: random.Random, doc: dict[str, Any]) -> dict[str, Any]:
    names = tensor_names(doc)
    if not names:
        doc["t"] = rng.choice([None, 1, [], {}])
        return doc
    name = rng.choice(names)
    entry = doc[name]
    kind = rng.randrange(6)
    if kind == 0:  # serde's other spelling of a struct: its fields as an array
        doc[name] = [entry["dtype"], entry["shape"], entry["data_offsets"]] + (
            [1] if rng.random() < 0.3 else []
        )
    elif kind == 1:
        depth = rng.choice([1, 124, 125, 126, 127])
        entry["extra"] = json.loads("[" * depth + "]" * depth)
    elif kind == 2:
        entry["extra"] = rng.choice([NEG_ZERO, HUGE_FLOAT, 10**30, -(10**30), 1.5, "\ud800", "x", None])
    elif kind == 3:
        del entry[rng.choice(["dtype", "shape", "data_offsets"])]
    elif kind == 4:
        doc[name] = rng.choice([None, 1, "x", [], {}])
    else:
        entry["dtype"] = {entry["dtype"]: None}
    return doc


def mutate_json(rng: random.Random, b: Base) -> tuple[str, bytes]:
    doc = json.loads(json.dumps(b.doc))  # a deep copy
    data = b.data
    text: bytes | None = None
    kind = rng.choice(["offsets", "dtype", "shape", "names", "metadata", "entry", "respell"])
    if kind == "offsets":
        doc, data = edit_offsets(rng, doc, data)
    elif kind == "dtype":
        doc = edit_dtype(rng, doc)
    elif kind == "shape":
        doc = edit_shape(rng, doc)
    elif kind == "names":
        doc, text = edit_names(rng, doc)
    elif kind == "metadata":
        doc, text = edit_metadata(rng, doc)
    elif kind == "entry":
        doc = edit_entry(rng, doc)
    if text is None:
        text = dump(doc, rng)
    return f"json-{kind}", assemble(text + b" " * rng.choice([0, 0, 1, 5]), data)


def mutate_bytes(rng: random.Random, b: Base) -> tuple[str, bytes]:
    header = bytearray(json.dumps(b.doc).encode() + b.padding)
    kind = rng.choice(["flip", "insert", "delete", "token", "pad"])
    at = rng.randrange(len(header) + 1)
    if kind == "flip":
        for _ in range(rng.randint(1, 3)):
            header[rng.randrange(len(header))] ^= rng.randint(1, 255)
    elif kind == "insert":
        header[at:at] = rng.choice(BYTES) if rng.random() < 0.5 else rng.randbytes(rng.randint(1, 3))
    elif kind == "delete":
        del header[at : at + rng.randint(1, 4)]
    elif kind == "token":
        header[at:at] = rng.choice(TOKENS)
    else:  # padding before and/or after the JSON
        before = b"".join(rng.choice(BYTES[:4]) for _ in range(rng.randint(0, 3)))
        after = b"".join(rng.choice(BYTES) for _ in range(rng.randint(0, 3)))
        header = bytearray(before) + header + bytearray(after)
    # Mostly the prefix follows the edit (so the JSON is what changed); sometimes it does not.
    length = len(header) if rng.random() < 0.8 else len(json.dumps(b.doc).encode() + b.padding)
    return f"bytes-{kind}", assemble(bytes(header), b.data, length=length)


def mutate_prefix(rng: random.Random, b: Base) -> tuple[str, bytes]:
    content = b.content()
    n = struct.unpack("<Q", content[:8])[0]
    choices = [n + d for d in (-8, -2, -1, 1, 2, 8)] + [0, 1, len(content) - 8, len(content) - 7]
    choices += [MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, 2**63, 2**64 - 1]
    length = rng.choice(choices)
    return "prefix", struct.pack("<Q", length % 2**64) + content[8:]


def mutate_length(rng: random.Random, b: Base) -> tuple[str, bytes]:
    content = b.content()
    if rng.random() < 0.5:
        return "file-truncated", content[: rng.randrange(len(content))]
    return "file-extended", content + (bytes(rng.randint(1, 9)) if rng.random() < 0.5 else b" ")


def mutate_several(rng: random.Random, b: Base) -> tuple[str, bytes]:
    """A JSON edit, then a byte edit of the result (a Base rebuilt from the first one's text)."""
    _, content = mutate_json(rng, b)
    n = struct.unpack("<Q", content[:8])[0]
    try:
        doc = json.loads(content[8 : 8 + n])
    except ValueError:
        return "combined", content
    if not isinstance(doc, dict):
        return "combined", content
    _, content = rng.choice([mutate_bytes, mutate_prefix, mutate_length])(rng, Base(doc, content[8 + n :]))
    return "combined", content


def relayout(rng: random.Random, b: Base) -> tuple[str, bytes]:
    """A different valid file from the same tensors: data order shuffled, dtypes and shapes
    redrawn (F4 with an even last dimension), zero-size tensors put at random boundaries."""
    tensors = []
    for name in tensor_names(b.doc):
        dtype = rng.choice([*SAFETENSORS_DTYPES[:-2]])  # all but F6, which torch cannot hold
        shape = [rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(rng.randrange(4))]
        if dtype == "F4":
            shape = [*shape, 2 * rng.randint(0, 3)]
        tensors.append((name, dtype, shape))
    rng.shuffle(tensors)
    metadata = b.doc.get("__metadata__") if rng.random() < 0.7 else {"k": rng.choice(["", "v", "ü"])}
    moved = base(rng, tensors, metadata)
    return "relayout", assemble(dump(moved.doc, rng) + b" " * rng.randrange(8), moved.data)


MUTATORS = [mutate_json] * 5 + [mutate_bytes] * 3 + [mutate_prefix, mutate_length, mutate_several, relayout]


def hand_written_cases() -> Iterator[tuple[str, bytes]]:
    """The cases of the issue, spelled out (and found again by the random ones)."""
    w = b'{"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}'
    yield "issue", assemble(w + b" ", b"xy", length=len(w) - 1)  # off by one, still valid JSON
    yield "issue", assemble(w + b" ", b"xy", length=len(w) + 1)
    yield "issue", assemble(b" \n\t" + w, b"xy")
    yield "issue", assemble(b'{"": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}', b"xy")
    yield (
        "issue",
        assemble(b'{"f4": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]}}', b"\x12\x34\x56\x78"),
    )
    for dims in (b"[0, 9223372036854775808]", b"[0, 9223372036854775807]", b"[4611686018427387904, 4, 0]"):
        yield (
            "issue",
            assemble(b'{"e": {"dtype": "U8", "shape": ' + dims + b', "data_offsets": [0, 0]}}', b""),
        )
    yield "issue", assemble(w, b"x")  # shorter than its header says
    yield "issue", assemble(w, b"xyz")  # bytes after the last tensor


@dataclass
class Case:
    number: int
    category: str
    content: bytes
    path: Path


def generate(directory: Path) -> list[Case]:
    rng = random.Random(SEED)
    files = directory / "cases"
    files.mkdir()
    pool = bases(rng, directory)
    fixed = [("base", b.content()) for b in pool] + list(hand_written_cases())
    cases: list[Case] = []
    seen: set[bytes] = set()
    while len(cases) < CASES:
        category, content = fixed.pop(0) if fixed else rng.choice(MUTATORS)(rng, rng.choice(pool))
        if content in seen:
            continue
        seen.add(content)
        path = files / f"{len(cases):05d}.safetensors"
        path.write_bytes(content)
        cases.append(Case(len(cases), category, content, path))
    return cases


# --- running the workers ---------------------------------------------------------------------


class Worker:
    """One worker process and the case it is on."""

    def __init__(self, command: list[str], log: IO[bytes]) -> None:
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=WORKER.parent,
        )
        self.case: Case | None = None
        self.deadline = 0.0

    def start(self, case: Case, timeout: float) -> None:
        assert self.process.stdin is not None
        self.case = case
        self.deadline = time.monotonic() + timeout
        self.process.stdin.write(f"{case.path}\n".encode())
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


def run_all(
    cases: list[Case],
    log: IO[bytes],
    *,
    command: tuple[str, ...] = (sys.executable, str(WORKER)),
    timeout: float = CASE_TIMEOUT_S,
) -> dict[int, dict[str, Any]]:
    """Each case's facts from a worker; a worker that dies or hangs is replaced, its case reported."""
    pending = list(reversed(cases))
    workers = [Worker(list(command), log) for _ in range(min(2, os.cpu_count() or 1))]
    facts: dict[int, dict[str, Any]] = {}
    try:
        while pending or any(w.case for w in workers):
            for w in workers:
                if w.case is None and pending:
                    w.start(pending.pop(), timeout)
            busy = {w.process.stdout: w for w in workers if w.case is not None}
            wait = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            ready, _, _ = select.select(list(busy), [], [], wait)
            for i, w in enumerate(workers):
                if w.case is None:
                    continue
                answer = b""
                if w.process.stdout in ready:
                    assert w.process.stdout is not None
                    answer = w.process.stdout.readline()
                elif time.monotonic() < w.deadline:
                    continue
                if answer:
                    facts[w.case.number] = json.loads(answer)
                    w.case = None
                    continue
                closed = w.process.stdout in ready  # its output ended: it died (or is dying)
                if closed:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        w.process.wait(timeout=timeout)
                w.stop()
                facts[w.case.number] = {
                    "failure": f"worker died ({w.process.returncode})" if closed else "hang"
                }
                workers[i] = Worker(list(command), log)
    finally:
        for w in workers:
            w.stop()
    return facts


def verdict(case: Case, facts: dict[str, Any]) -> str:
    """'accept', 'reject', 'documented: ...', or 'FAIL: ...' for one case."""
    if "failure" in facts:
        return f"FAIL: {facts['failure']}"
    if facts.get("raw_exception"):
        return f"FAIL: streamer raised {facts['ours']}"
    theirs, ours = facts.get("theirs"), facts.get("ours")
    if theirs is None and ours is None:
        difference = facts["difference"]
        return "accept" if difference is None else f"FAIL: both load it, but {difference}"
    if theirs is None:
        for name, (applies, messages) in DOCUMENTED_DIFFERENCES.items():
            if applies(case.content) and any(m in ours for m in messages):
                return f"documented: {name}"
        return f"FAIL: safetensors loads it, streamer refused: {ours}"
    if ours is None:
        return f"FAIL: safetensors refused ({theirs}), streamer loaded {facts['tensors']} tensors"
    if facts["ours_path"] != str(case.path):
        return f"FAIL: the error names {facts['ours_path']!r}, not the file: {ours}"
    return "reject"


def test_streamer_agrees_with_safetensors_on_mutated_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = generate(tmp_path)
    with open(tmp_path / "workers.log", "wb") as log:
        facts = run_all(cases, log)
    table: dict[str, Counter[str]] = defaultdict(Counter)
    failures = []
    for case in cases:
        outcome = verdict(case, facts[case.number])
        table[case.category][outcome.split(":")[0]] += 1
        if outcome.startswith("FAIL"):
            failures.append(f"case {case.path.name} ({case.category}): {outcome}")
    totals = sum(table.values(), Counter())
    with capsys.disabled():
        print(f"\ndifferential fuzz, {len(cases)} files (seed {SEED}):")
        for category, counts in sorted(table.items()):
            print(f"  {category:18} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        print(f"  {'total':18} " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())))
    assert not failures, f"{len(failures)} cases disagree:\n" + "\n".join(failures[:30])
    # The generator must reach both sides, or bit-exactness and refusals go untested.
    assert totals["accept"] >= 300 and totals["reject"] >= 1500 and totals["documented"] >= 20


# --- the same differences, loaded in process -------------------------------------------------


def test_f4_loads_bit_exact_like_safetensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    tensors = {
        f"fp4.{i}": torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(torch.float4_e2m1fn_x2)
        for i, shape in enumerate([(1,), (7,), (3, 5), (0, 4), (2, 3, 300)])
    }
    path = tmp_path / "fp4.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    expected = safetensors.torch.load_file(str(path))
    for config in (streamer.StreamerConfig(block_size=64, concurrency=3), streamer.StreamerConfig()):
        got = streamer.load_file(path, config=config)
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            assert (got[name].dtype, got[name].shape) == (torch.float4_e2m1fn_x2, tensor.shape)
            assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8))
            assert torch.equal(got[name].view(torch.uint8), tensors[name].view(torch.uint8))


def test_zero_size_tensor_with_huge_dims_loads_like_safetensors(tmp_path: Path) -> None:
    header = b'{"e": {"dtype": "BF16", "shape": [0, 4611686018427387904, 4], "data_offsets": [0, 0]}}'
    path = tmp_path / "huge.safetensors"
    path.write_bytes(assemble(header, b""))
    expected = safetensors.torch.load_file(str(path))["e"]
    with streamer.open(path) as s:
        got = dict(s)["e"]
        assert s.get_tensor("e").shape == expected.shape
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape)


def test_a_worker_that_dies_or_hangs_fails_its_case_and_is_replaced(tmp_path: Path) -> None:
    """The harness itself: a crash or a hang is a named failure, and the next case still runs."""
    cases = [Case(i, "harness", b"", tmp_path / f"{i}.safetensors") for i in range(3)]
    # Answers its first case, then dies on the second (exit 3) or hangs on it.
    answer = json.dumps({"difference": None})
    script = f"import sys\nsys.stdin.readline(); print({answer!r}, flush=True)\nsys.stdin.readline()\n"
    with open(tmp_path / "workers.log", "wb") as log:
        died = run_all(cases, log, command=(sys.executable, "-c", script + "sys.exit(3)"))
        hung = run_all(cases, log, command=(sys.executable, "-c", script + "sys.stdin.read()"), timeout=1.0)
    for facts in (died, hung):
        assert sorted(facts) == [0, 1, 2]
        assert sum("failure" not in f for f in facts.values()) >= 1  # some cases were answered
    assert {verdict(c, died[c.number]) for c in cases} >= {"FAIL: worker died (3)"}
    assert {verdict(c, hung[c.number]) for c in cases} >= {"FAIL: hang"}


def test_a_truncated_file_is_caught_as_header_and_as_read_error(tmp_path: Path) -> None:
    """The README promised ReadError, the code raised HeaderError: TruncatedFileError is both."""
    header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
    path = tmp_path / "short.safetensors"
    path.write_bytes(assemble(header, bytes(12)))
    for caught in (streamer.ReadError, streamer.HeaderError, streamer.TruncatedFileError):
        with pytest.raises(caught) as info:
            streamer.load_file(path)
        assert type(info.value) is streamer.TruncatedFileError
        assert (info.value.path, info.value.tensor) == (str(path), "w")
