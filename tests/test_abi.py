"""The binding and the C library agree: declarations come from the header, stale builds are refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from streamer.config import DIRECT_IO_ALIGNMENT
from streamer.engine import _ffi, native
from streamer.engine.declarations import header_path, parse_header

HEADER = header_path()
STRUCTS = {
    "se_unit": ["file", "begin", "end", "need"],
    "se_block": [
        "file",
        "first_unit",
        "last_unit",
        "acc_begin",
        "acc_end",
        "read_offset",
        "read_length",
        "dst",
    ],
    "se_error_info": ["code", "sys_errno", "file", "offset", "expected", "got"],
    "se_stats": ["bytes_read", "blocks_done", "read_seconds", "idle_seconds"],
}


def _compiler() -> str:
    found = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert found is not None, "a C compiler is needed (the package itself is built with one)"
    return found


def _shared_library(tmp_path: Path, source: str) -> Path:
    c_file = tmp_path / "stale.c"
    c_file.write_text(textwrap.dedent(source))
    library = tmp_path / "libstale.so"
    subprocess.run([_compiler(), "-shared", "-fPIC", "-o", str(library), str(c_file)], check=True)
    return library


def _load_with(library: Path) -> subprocess.CompletedProcess[str]:
    code = "import streamer.engine.native as n; n._lib()"
    env = {**os.environ, "STREAMER_NATIVE_LIB": str(library)}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, timeout=120
    )


def test_every_declared_function_is_in_the_library() -> None:
    library = native._lib()
    declared = sorted(name for name in dir(library) if name.startswith("se_"))
    assert "se_abi_version" in declared and "se_engine_create" in declared
    for name in declared:
        assert callable(getattr(library, name)), name
    assert library.se_abi_version() == native.ABI_VERSION


def test_constants_are_the_headers() -> None:
    text = HEADER.read_text()
    for name, value in [("SE_ERR_EXTERNAL", native.ERR_EXTERNAL), ("SE_OK", native.OK)]:
        assert f"#define {name} " in text
        assert native._CONSTANTS[name] == value
    assert native.ERR_CANCELLED == -5 and native.ERR_TRUNCATED == -4


def test_the_emitted_constants_and_hash_are_the_installed_headers() -> None:
    """The import reads the constants from ``_ffi.py``, parsed from this very header."""
    import hashlib

    assert parse_header(HEADER.read_text())[1] == _ffi.CONSTANTS
    assert hashlib.sha256(HEADER.read_bytes()).hexdigest() == _ffi.HEADER_SHA256


def test_struct_layout_matches_the_c_compiler(tmp_path: Path) -> None:
    """cffi's view of every struct (from the parsed header) is the compiler's, field by field."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", f'#include "{HEADER}"', "int main(void) {"]
    for struct, fields in STRUCTS.items():
        lines.append(f'printf("{struct} size %zu\\n", sizeof({struct}));')
        lines += [f'printf("{struct} {f} %zu\\n", offsetof({struct}, {f}));' for f in fields]
    lines += ["return 0;", "}"]
    program = tmp_path / "layout.c"
    program.write_text("\n".join(lines))
    binary = tmp_path / "layout"
    subprocess.run([_compiler(), "-o", str(binary), str(program)], check=True)
    printed = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split("\n")
    expected = []
    for struct, fields in STRUCTS.items():
        expected.append(f"{struct} size {native.ffi.sizeof(struct)}")
        expected += [f"{struct} {f} {native.ffi.offsetof(struct, f)}" for f in fields]
    assert printed[: len(expected)] == expected


def test_a_library_of_another_abi_version_is_refused(tmp_path: Path) -> None:
    library = _shared_library(tmp_path, f"int se_abi_version(void) {{ return {native.ABI_VERSION + 1}; }}\n")
    result = _load_with(library)
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "stale build" in result.stderr
    assert f"ABI version {native.ABI_VERSION + 1}" in result.stderr


def test_the_emitted_binding_is_the_headers() -> None:
    """``_ffi.py`` (cffi's parse of the header, kept as Python) declares what a fresh parse of the
    installed header declares: every type and every function, whatever cffi version wrote it."""
    cffi = pytest.importorskip("cffi")
    declarations, _ = parse_header(HEADER.read_text())
    assert declarations == _ffi.DECLARATIONS
    fresh = cffi.FFI()
    fresh.cdef(declarations)
    assert _ffi.ffi.list_types() == fresh.list_types()
    for struct, fields in STRUCTS.items():
        assert _ffi.ffi.sizeof(struct) == fresh.sizeof(struct), struct
        for field in fields:
            assert _ffi.ffi.offsetof(struct, field) == fresh.offsetof(struct, field), (struct, field)
    library = native._lib()
    fresh_library = fresh.dlopen(
        str(Path(native.__file__).resolve().parent.parent / "_native" / native._LIBRARY_NAME)
    )
    names = sorted(name for name in dir(fresh_library) if name.startswith("se_"))
    assert names == sorted(name for name in dir(library) if name.startswith("se_"))
    for name in names:  # an opaque struct is spelled with or without "struct": the same type
        emitted = str(_ffi.ffi.typeof(getattr(library, name))).replace("struct ", "")
        parsed = str(fresh.typeof(getattr(fresh_library, name))).replace("struct ", "")
        assert emitted == parsed, name


def test_the_committed_binding_is_what_the_emitter_writes() -> None:
    """``scripts/emit_ffi.py --check`` from a checkout (the wheel has no scripts/)."""
    cffi = pytest.importorskip("cffi")
    script = Path(__file__).resolve().parent.parent / "scripts" / "emit_ffi.py"
    if not script.is_file():
        pytest.skip("not a checkout")
    if cffi.__version__ != _ffi.CFFI_VERSION:  # another cffi may write other bytes for the same types
        pytest.skip(f"_ffi.py was written by cffi {_ffi.CFFI_VERSION}, this is {cffi.__version__}")
    result = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_a_header_the_binding_was_not_made_from_is_refused(tmp_path: Path) -> None:
    """An installed header with one declaration more than ``_ffi.py``: the import says to re-emit."""
    installed = Path(native.__file__).resolve().parent.parent
    copy = tmp_path / "streamer"
    shutil.copytree(installed, copy, ignore=shutil.ignore_patterns("__pycache__"))
    header = copy / "_native" / "streamer_engine.h"
    header.write_text(
        header.read_text().replace("#ifdef __cplusplus", "int32_t se_new_thing(void);\n#ifdef __cplusplus", 1)
    )
    code = "import streamer.engine.native"
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd="/",
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and "scripts/emit_ffi.py" in result.stderr, result.stderr


def test_an_install_without_its_header_says_so(tmp_path: Path) -> None:
    installed = Path(native.__file__).resolve().parent.parent
    copy = tmp_path / "site" / "streamer"
    shutil.copytree(installed, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "_native" / "streamer_engine.h").unlink()
    result = subprocess.run(
        [sys.executable, "-c", "import streamer.engine.native"],
        env={**os.environ, "PYTHONPATH": str(copy.parent)}, cwd="/",
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "ImportError: streamer's engine header is unreadable" in result.stderr, result.stderr
    assert "reinstall the package" in result.stderr


def test_a_library_from_before_abi_versions_is_refused(tmp_path: Path) -> None:
    library = _shared_library(tmp_path, "int se_engine_create(void) { return 0; }\n")
    result = _load_with(library)
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "ABI version None" in result.stderr


@pytest.mark.parametrize(
    "line", ["#define SE_X (-12)   /* note */", "#define SE_X -12", "#define SE_X ( -12 )"]
)
def test_header_constants_parse(line: str) -> None:
    declarations, constants = parse_header(line + "\nint32_t se_f(void);\n")
    assert constants == {"SE_X": -12}
    assert declarations.strip() == "int32_t se_f(void);"


@pytest.mark.parametrize("line", ["#define SE_X 0x10", "#define SE_X (1 << 3)", "#define SE_X"])
def test_a_header_constant_the_binding_cannot_read_is_an_error(line: str) -> None:
    with pytest.raises(ImportError, match="cannot read the constant"):
        parse_header(line + "\n")


def test_a_block_array_is_an_se_block_array() -> None:
    """What the engine reads through ``ffi.from_buffer`` is the blocks given, field by field; indexing,
    iterating and rebasing give the same blocks as tuples."""
    blocks = native.BlockArray.build(
        file=3,
        unit=7,
        acc_begin=np.array([100, 9000]),
        acc_end=np.array([200, 9500]),
        read_offset=np.array([0, 8192]),
        read_length=np.array([4096, 4096]),
        dst=np.array([0, 4096]),
    )
    expected = [
        native.Block(3, 7, 7, 100, 200, 0, 4096, 0),
        native.Block(3, 7, 7, 9000, 9500, 8192, 4096, 4096),
    ]
    assert list(blocks) == expected and blocks[1] == expected[1] and list(blocks[1:]) == expected[1:]
    rebased = blocks.rebased(1 << 40)
    assert [b.dst for b in rebased] == [1 << 40, (1 << 40) + 4096] and [b.dst for b in blocks] == [0, 4096]
    seen = native.ffi.cast("se_block *", native.ffi.from_buffer(rebased.table))
    for i, block in enumerate(expected):
        entry = seen[i]
        got = (entry.file, entry.first_unit, entry.last_unit, entry.acc_begin, entry.acc_end)
        assert got == block[:5]
        assert (entry.read_offset, entry.read_length) == (block.read_offset, block.read_length)
        assert int(native.ffi.cast("uintptr_t", entry.dst)) == (1 << 40) + block.dst
    with pytest.raises(ValueError, match="BLOCK_DTYPE"):
        native.BlockArray(np.zeros(2, dtype=np.int64))


def test_the_direct_io_alignment_is_the_engines() -> None:
    assert native.DIRECT_ALIGNMENT == DIRECT_IO_ALIGNMENT
