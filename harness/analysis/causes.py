"""The cache-break causes: one vocabulary for the attribution (`analysis.explain`), its CLI (`kvscope explain`,
whose help lists them) and the explain page (`analysis.explain_experiment`: words, colours, findings).

A module of its own, with nothing but the standard library, so the command line can list the causes in its help
without importing the attribution (numpy, the cache model: seconds at every ``--help``)."""

from __future__ import annotations

from enum import StrEnum


class Cause(StrEnum):
    """Why a request recomputed tokens an earlier request had (`analysis.explain`'s module doc says how each is recognised): the
    one vocabulary of the attribution's ``cause``, which ``kvscope explain`` prints and writes, and the explain
    page's words, colours and findings are keyed by. A ``StrEnum`` so a member *is* the string written to JSON."""

    VOLATILE_FIELD = "volatile_field"
    SYSTEM_PROMPT_CHANGED = "system_prompt_changed"
    TOOLS_CHANGED = "tools_changed"
    MESSAGE_EDITED = "message_edited"
    HISTORY_TRUNCATED = "history_truncated"
    COMPACTION = "compaction"
    MODEL_SWITCH = "model_switch"  # routed runs: the session's previous step ran on another model (its own cache)
    EVICTED = "evicted"
    PREFIX_CHANGED = "prefix_changed"  # traces without message structure: a segment changed, the trace says no more
