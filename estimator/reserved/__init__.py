"""Reserved memory from the caching-allocator model: each rank's own event stream, expanded from its profile to
the full depth (``expand``), with setup and repeated steps (``timeline``), replayed through
``estimator.allocator`` until the cache repeats."""
