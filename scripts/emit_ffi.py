"""Writes ``streamer/engine/_ffi.py``: the engine's C declarations, parsed once by cffi and kept as
Python source (cffi's out-of-line ABI mode), so that importing streamer parses no C.

    python scripts/emit_ffi.py                # after changing native/include/streamer_engine.h
    python scripts/emit_ffi.py --check        # exit 1 if the committed file is not what it writes

Parsing the header with ``cffi.FFI.cdef`` took ~120 ms of every process's ``import streamer``;
loading the emitted types takes ~2 ms. The emitted file keeps the header's ``SE_*`` constants
(so no import reads them out of C either), the declarations it was made from and the header's
SHA-256: ``streamer.engine.native`` refuses to load when the installed header's bytes differ, and
CI runs ``--check`` (``tests/test_abi.py``), so the binding still cannot drift from the header. This
reads the checkout's files only: it never imports the ``streamer`` package (whose engine binding
needs the file it writes).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
import tempfile
from pathlib import Path

import cffi

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "native" / "include" / "streamer_engine.h"
TARGET = ROOT / "streamer" / "engine" / "_ffi.py"


def _parse_header(text: str) -> tuple[str, dict[str, int]]:
    """The declarations and constants, by ``streamer/engine/declarations.py`` (loaded from its file)."""
    spec = importlib.util.spec_from_file_location(
        "_declarations", ROOT / "streamer" / "engine" / "declarations.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parsed: tuple[str, dict[str, int]] = module.parse_header(text)
    return parsed


def emit(header: Path, target: Path) -> None:
    """Writes the cffi module of ``header``'s declarations to ``target``."""
    declarations, constants = _parse_header(header.read_text())
    ffi = cffi.FFI()
    ffi.cdef(declarations)
    ffi.set_source("streamer.engine._ffi", None)
    ffi.emit_python_code(str(target))
    text = target.read_text()
    target.write_text(
        "# Written by scripts/emit_ffi.py from native/include/streamer_engine.h: do not edit.\n"
        + text
        + "\n# The header it was made from (SHA-256, declarations, constants) and the cffi that wrote it.\n"
        + f"HEADER_SHA256 = {hashlib.sha256(header.read_bytes()).hexdigest()!r}\n"
        + f"DECLARATIONS = {declarations!r}\n"
        + f"CONSTANTS = {constants!r}\n"
        + f"CFFI_VERSION = {cffi.__version__!r}\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        emit(HEADER, TARGET)
        print(f"wrote {TARGET.relative_to(ROOT)}", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory() as directory:
        fresh = Path(directory) / "_ffi.py"
        emit(HEADER, fresh)
        if fresh.read_text() != TARGET.read_text():
            print(f"{TARGET.relative_to(ROOT)} is stale: run python scripts/emit_ffi.py", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
