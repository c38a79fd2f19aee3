"""The exact model of vLLM's prefix cache: block hashing, block pool, eviction order, simulator, routing, ideal hit ratio, KV memory. Knows no HTTP."""
