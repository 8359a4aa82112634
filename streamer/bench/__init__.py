"""Cold-start timing of safetensors loaders: ``python -m streamer.bench`` / ``streamer-bench``.

One module, one job:

- ``cli``        argument parsing and the run's phases, in order;
- ``units``      sizes and rates, parsed and printed;
- ``synthetic``  a Llama-like bf16 checkpoint of any size, sharded like Hugging Face;
- ``checkpoint`` which files a source means;
- ``loaders``    the loaders we compare (what each needs, its settings, its environment);
- ``child``      the fresh subprocess that times exactly one load and prints one JSON line;
- ``runner``     interleaved runs, each after the page cache was evicted or filled and checked;
- ``cache``      page-cache eviction and verification (through ``streamer.pagecache``);
- ``ceilings``   what the hardware allows: sequential reads (fio), memcpy, first touch, H2D;
- ``machine``    facts about the machine and the versions in use;
- ``report``     statistics, the table and the JSON document (``schema.json``);
- ``plot``       the optional PNG (matplotlib).
"""
