"""``python -m streamer_bench``."""

from streamer_bench.cli import main

raise SystemExit(main())
