"""The seed documents' teaching models (batching, roofline, speculative decoding, KV memory demo) and the primer notebook's tables."""
