"""One TLS context for kvscope's control-plane HTTP calls (httpx: readiness, facts, ``/metrics``, prefix-cache
resets, warm-up, calibration).

Why: httpx builds a new SSL context for every client and every top-level ``httpx.get``, reading the CA bundle
each time, also for the plain-http URL of a local server, and a replay made three such calls before its first
request (readiness, server facts, vocabulary): a visible share of a short replay against the mock server
(cProfile figures: benchmarks/README.md, "Figures the design notes cite").  The context is built once, lazily,
the way httpx builds its default (certifi, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``), so what is verified does
not change.
"""

from __future__ import annotations

import functools
import ssl


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default verifying context, built on first use and shared (``verify=tls_context()``)."""
    import httpx  # deferred: httpx is heavy, only talking to a server needs it

    return httpx.create_ssl_context()
