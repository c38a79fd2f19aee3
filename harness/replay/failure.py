"""When a replay counts as failed: its share of failed requests is above a threshold.

A run at 100 % HTTP 401 used to exit 0 and an experiment cell with 3/3 failed requests was "ok". The verdict
is a pure function of the summary so that the replay CLI (exit 1) and the experiment runner (cell "failed")
use the same rule and the same one-line reason.
"""

from __future__ import annotations

from typing import Any

DEFAULT_MAX_ERROR_SHARE = 0.05


def replay_failure_reason(summary: dict[str, Any], max_error_share: float = DEFAULT_MAX_ERROR_SHARE) -> str | None:
    """``"100 % of 40 requests failed (http_401: 40)"`` when more than ``max_error_share`` of the requests in
    the measurement window failed, else None. A run that sent nothing is not judged here."""
    req = summary["requests"]
    counted = int(req.get("in_window", req["sent"]))
    failed = int(req["failed"])
    if counted == 0 or failed / counted <= max_error_share:
        return None
    classes = ", ".join(f"{k}: {v}" for k, v in sorted((req.get("errors_by_class") or {}).items(),
                                                        key=lambda kv: -kv[1]))
    share = 100.0 * failed / counted
    return (f"{share:.0f} % of {counted} requests failed" + (f" ({classes})" if classes else "")
            + f"; allowed: at most {max_error_share:.0%} (--max-error-share)")
