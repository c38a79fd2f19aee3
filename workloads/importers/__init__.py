"""Importers of real traces and the JSONL exporter.

Block-id traces (Mooncake: 512-token chained ``hash_ids``; kv-cache-tester: 64-token full-block chained ids)
are available two ways:

* the raw block view (:func:`read_mooncake`, :func:`read_kvcache_tester`): per request, its block ids, input
  and output lengths and timestamps, as :class:`BlockRequest` rows. The offline simulator reads these directly.
* a token trace (:func:`import_mooncake`, :func:`import_kvcache_tester`): each distinct block id becomes one
  segment of ``block_size`` fresh tokens, so equal ids give equal token blocks and different ids different
  blocks, and the reuse structure survives exactly.
"""

from kvscope.workloads.importers.blocks import (
    BlockRequest,
    blocks_to_trace,
    import_kvcache_tester,
    import_mooncake,
    read_kvcache_tester,
    read_mooncake,
)
from kvscope.workloads.importers.jsonl import export_jsonl, import_jsonl

__all__ = ["BlockRequest", "blocks_to_trace", "read_mooncake", "read_kvcache_tester", "import_mooncake",
           "import_kvcache_tester", "import_jsonl", "export_jsonl"]
