"""Encoder caches: content keys, the sharded tensor store, and the fills of the cache stages."""
