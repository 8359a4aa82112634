"""Cold-start timing of safetensors loaders, local or S3: ``python -m streamer_bench`` / ``streamer-bench``.

One module, one job:

- ``arguments``  the command line: every option, parsed and checked;
- ``cli``        the run's phases, in order;
- ``units``      sizes and rates, parsed and printed;
- ``synthetic``  a Llama-like bf16 checkpoint of any size, sharded like Hugging Face;
- ``files``      which files (or S3 objects) a source means;
- ``loaders``    the loaders we compare (what each needs, its settings, its environment);
- ``child``      the fresh subprocess that times exactly one load and prints one JSON line;
- ``runner``     interleaved runs, each after the page cache was evicted or filled and checked
                 (or none of that: the "remote" state of S3 sources);
- ``pagecache``  page-cache eviction and verification (``posix_fadvise``, ``mincore``);
- ``ceilings``   what the hardware allows: sequential reads (fio), memcpy, first touch, H2D; for S3
                 the boto3 ranged-GET rate;
- ``s3peers``    plain boto3 reads of S3 objects: ranged GETs into memory, download to files;
- ``facts``      facts about the machine and the versions in use;
- ``report``     statistics, the table and the JSON document (``schema.json``);
- ``plot``       the optional PNG (matplotlib).
"""
