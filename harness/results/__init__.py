"""Result files: their schemas, writers and loaders (request records, summaries, manifests, experiments)."""
