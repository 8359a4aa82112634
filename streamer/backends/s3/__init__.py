"""S3 on the shared object-store client (``backends/http/``), by job: ``uri`` (names),
``classify`` (what an error answer means), ``sigv4`` (presigned requests), ``identity``
(credentials and region as boto3 finds them), ``redact`` (no credential in a log), ``client``
(URLs, the ETag rule, listings), ``storage`` (the ``Storage``)."""
