"""A local cache of object-storage blocks, in front of the S3 storage (``StreamerConfig.cache``)."""
