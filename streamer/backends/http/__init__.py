"""The data path every HTTP object store shares: ranged HTTP/1.1 GETs whose bodies are received
straight into destination memory, retried and verified.

Why our own: an SDK's HTTP stack (aiobotocore's aiohttp, google-cloud-storage's requests) hands a
body over as ``bytes`` chunks, each then copied into place, plus milliseconds of SDK machinery per
request: on the 2-core machines we measure on that capped loads near 0.5 GB/s on one event loop
thread, where a ``BufferedProtocol`` that lets the kernel ``recv_into`` the destination reaches
~2 GB/s. And an SDK's import and client set-up cost a cold start ~0.5 s before its first request.
Each store signs its requests its own way (S3: a SigV4 presigned URL, ``s3/sigv4.py``; GCS: a
bearer token from google-auth; Azure: a SAS or a bearer token) and this package sends every GET,
the control plane's (header reads, listings: ``rest.py``) as the data path's: keep-alive
connections, ``Range`` and identity headers, the status line and headers parsed here, the body
written where it belongs.

Proxies: the ones the environment names (``HTTP_PROXY``, ``HTTPS_PROXY``, ``NO_PROXY``), by the
rule of ``urllib.request`` (botocore's and requests' too), so the data GETs take the same path as
the SDKs' header reads and listings. Plain ``http`` targets are asked for in absolute form;
``https`` ones go through a ``CONNECT`` tunnel with TLS end to end. Only ``http://`` proxies work.

Every success is checked before a body byte lands: status, ``Content-Range`` (exactly the bytes
asked for, of an object of the size expected), ``Content-Length`` (strict: duplicates must agree),
no ``Content-Encoding``, then the store's identity rule (an ETag, a generation). Interim ``1xx``
answers are skipped, chunked bodies decoded into place (only their framing is copied), bodies
without a length read to the close.

Modules: ``endpoint`` (target, proxy, tunnel), ``response`` (parsing and checks, no sockets),
``connection`` (one request at a time on a keep-alive connection), ``timing`` (each try's bounds),
``client`` (the store-agnostic client: loop thread, retries, ``fetch_into``), ``objects`` (names
and versions), ``feeder`` (a run's blocks), ``storage`` (the ``Storage`` every store shares:
resolution, header fronts, feeds).
"""
