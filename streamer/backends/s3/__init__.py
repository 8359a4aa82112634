"""S3, by job: ``uri`` (names), ``classify`` (what a failure means), ``redact`` (no credential in
a log), ``client`` (the event-loop client and its verified requests), ``feeder`` (a run's blocks),
``storage`` (the ``Storage``: resolution, header fronts, feeds)."""
