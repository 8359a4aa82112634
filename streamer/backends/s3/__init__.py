"""S3 on the shared object-store client (``backends/http/``), by job: ``uri`` (names),
``classify`` (what a failure means), ``redact`` (no credential in a log), ``client`` (SigV4
presigned GETs, the ETag rule, aiobotocore for header reads and listings), ``storage`` (the
``Storage``)."""
