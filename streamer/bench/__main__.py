"""``python -m streamer.bench``."""

from streamer.bench.cli import main

raise SystemExit(main())
