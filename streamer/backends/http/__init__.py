"""Ranged HTTP/1.1 GETs whose bodies are received straight into destination memory.

The S3 data path. aiobotocore (aiohttp) hands a body over as ``bytes`` chunks of at most 64 KiB,
each then copied into place, plus several milliseconds of botocore machinery per request: on the
2-core machines we measure on that capped loads near 0.5 GB/s on one event loop thread, where a
``BufferedProtocol`` that lets the kernel ``recv_into`` the destination itself reaches ~2 GB/s.
So the backend signs each object's URL once with botocore (a SigV4 presigned GET URL: endpoint,
addressing style, region, credentials and session token all as the client resolved them) and
this module sends the GETs: one persistent keep-alive connection per worker, ``Range`` and
``If-Match`` headers, the status line and headers parsed here, the body written where it belongs.

Proxies: the ones the environment names (``HTTP_PROXY``, ``HTTPS_PROXY``, ``NO_PROXY``), chosen
by botocore's own rule, so the data GETs take the same path as the client's header reads and
listings. Plain ``http`` targets are asked for in absolute form; ``https`` ones go through a
``CONNECT`` tunnel with TLS end to end. Only ``http://`` proxies are supported.

Every success is checked before a body byte lands: status, ``Content-Range`` (exactly the bytes
asked for, of an object of the size expected), ``Content-Length`` (strict: duplicates must agree),
no ``Content-Encoding``, then the caller's ``verify`` of the headers (the ETag). Interim ``1xx``
answers are skipped, chunked bodies decoded into place (only their framing is copied), bodies
without a length read to the close. Nothing here retries or knows S3 semantics beyond reading an
error's ``<Code>``, ``<Endpoint>`` and ``<Region>``; failures are ``HttpFailure`` (an error
status), ``ProtocolViolation`` (an answer that breaks HTTP or is not the range asked for),
``SizeChanged``, ``ProxyError`` (the proxy refused the tunnel) or ``OSError`` / ``TimeoutError``
(the connection broke or stalled), and ``received`` tells the caller how many body bytes count.
"""
