"""The engine's C header, read for Python: its declarations (for cffi) and its ``SE_*`` constants.

The header is installed beside the library; it is the one declaration of the ABI.
``scripts/emit_ffi.py`` parses it into ``_ffi.py``; an import only checks its SHA-256.
"""

from __future__ import annotations

import re
from pathlib import Path

HEADER_NAME = "streamer_engine.h"
_DEFINE = r"^#define\s+(SE_\w+)\s+\(?\s*(-?\d+)\s*\)?\s*$"


def header_path() -> Path:
    """The header installed beside the library, or the checkout's when running from source."""
    installed = Path(__file__).resolve().parent.parent / "_native" / HEADER_NAME
    if installed.is_file():
        return installed
    return Path(__file__).resolve().parents[2] / "native" / "include" / HEADER_NAME


def parse_header(text: str) -> tuple[str, dict[str, int]]:
    """The header's declarations for ``cffi.cdef`` and its ``SE_*`` integer constants.

    cffi parses plain C declarations but no preprocessor lines, so those are taken out here
    (comments first, then the C++ guard whole, the include guard, includes) and the
    ``#define SE_*`` constants are read into Python ints instead.
    """
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.DOTALL)
    constants: dict[str, int] = {}
    declarations = []
    for line in text.splitlines():
        if not line.startswith("#"):
            declarations.append(line)
            continue
        match = re.match(_DEFINE, line)
        if match is not None:
            constants[match.group(1)] = int(match.group(2))
        elif line.startswith("#define SE_"):
            raise ImportError(f"{HEADER_NAME}: cannot read the constant {line!r} (decimal integers only)")
    return "\n".join(declarations), constants
