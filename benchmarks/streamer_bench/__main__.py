"""``python -m streamer_bench``.

``-m`` puts the working directory first on the path: from a checkout's root (where
``benchmarks/s3_load.py`` runs it) that is the source tree's ``streamer``, which has no built
engine, in place of the installed one. It leaves the path before anything imports streamer; this
package is imported already.
"""

import sys

if not getattr(sys.flags, "safe_path", False):  # -P (3.11) leaves the directory off by itself
    del sys.path[0]

from streamer_bench.cli import main

raise SystemExit(main())
