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
    #: A recorded-mode replay sent the trace's planned answer where the server had generated another: the blocks
    #: holding the parent's output can never match, in any cache. An artefact of the replay, not of the traffic.
    REPLAY_SUBSTITUTED_OUTPUT = "replay_substituted_output"
    #: The prefix was computed by a request still running when this one was sent (concurrent sessions sharing
    #: it): it had never been cached before this request, so it was not evicted.
    NOT_YET_CACHED = "not_yet_cached"
    PREFIX_CHANGED = "prefix_changed"  # traces without message structure: a segment changed, the trace says no more
