"""When a replay counts as failed: its share of failed requests is above a threshold.

A run at 100 % HTTP 401 used to exit 0 and an experiment cell with 3/3 failed requests was "ok". The verdict
is a pure function of the summary so that the replay CLI (exit 1) and the experiment runner (cell "failed")
use the same rule and the same one-line reason.
"""

from __future__ import annotations

from kvscope.harness.results.summary import RequestCounts

DEFAULT_MAX_ERROR_SHARE = 0.05


def replay_failure_reason(requests: RequestCounts, max_error_share: float = DEFAULT_MAX_ERROR_SHARE) -> str | None:
    """``"100 % of 40 requests failed (http_401: 40)"`` when more than ``max_error_share`` of the requests in
    the measurement window failed (``requests``: summary.json's request counts), else None. A run that sent
    nothing is not judged here."""
    counted = requests.in_window
    failed = requests.failed
    if counted == 0 or failed / counted <= max_error_share:
        return None
    classes = ", ".join(f"{k}: {v}" for k, v in sorted(requests.errors_by_class.items(), key=lambda kv: -kv[1]))
    share = 100.0 * failed / counted
    return (f"{share:.0f} % of {counted} requests failed" + (f" ({classes})" if classes else "")
            + f"; allowed: at most {max_error_share:.0%} (--max-error-share)")
