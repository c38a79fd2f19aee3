"""Importers of real traces and the JSONL exporter.

Block-id traces (Mooncake: 512-token chained ``hash_ids``; kv-cache-tester: 64-token full-block chained ids)
are available two ways:

* the raw block view (:func:`read_mooncake`, :func:`read_kvcache_tester`): per request, its block ids, input
  and output lengths and timestamps, as :class:`BlockRequest` rows. The offline simulator reads these directly.
* a token trace (:func:`import_mooncake`, :func:`import_kvcache_tester`): each distinct block id becomes one
  segment of ``block_size`` fresh tokens, so equal ids give equal token blocks and different ids different
  blocks, and the reuse structure survives exactly.

Agent transcripts (Claude Code, Codex, OpenAI chat JSONL, SWE-agent, OpenHands) are parsed per format into model
calls and turned into text-mode traces by one shared step (:mod:`.agent`); TraceLab round traces hold counts only
(:mod:`.tracelab`).
"""

from kvscope.workloads.importers.blocks import (
    BlockRequest,
    blocks_to_trace,
    import_kvcache_tester,
    import_mooncake,
    read_kvcache_tester,
    read_mooncake,
)
from kvscope.workloads.importers.claude_code import import_claude_code
from kvscope.workloads.importers.codex import import_codex
from kvscope.workloads.importers.jsonl import export_jsonl, import_jsonl
from kvscope.workloads.importers.openai_chat import import_openai_chat
from kvscope.workloads.importers.openhands import import_openhands
from kvscope.workloads.importers.swe_agent import import_swe_agent
from kvscope.workloads.importers.tracelab import import_tracelab

# Agent transcripts → text-mode traces: format name (as `kvscope workload import FORMAT`) → (path, tokenizer dir).
TRANSCRIPT_IMPORTERS = {"claude-code": import_claude_code, "codex": import_codex, "openai-chat": import_openai_chat,
                        "swe-agent": import_swe_agent, "openhands": import_openhands}

__all__ = ["BlockRequest", "blocks_to_trace", "read_mooncake", "read_kvcache_tester", "import_mooncake",
           "import_kvcache_tester", "import_jsonl", "export_jsonl", "import_claude_code", "import_codex",
           "import_openai_chat", "import_swe_agent", "import_openhands", "import_tracelab", "TRANSCRIPT_IMPORTERS"]
