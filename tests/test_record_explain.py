"""`kvscope record` (proxy, exchange log, trace) and `kvscope explain` (cache-break attribution).

Unit tests build small recorded traces from synthetic exchanges, tokenized with the tiny model's tokenizer and a
tool-aware chat template, one per cause. The proxy tests run against the fault server (a fast mock). The `vllm`
test runs the scripted openai-SDK agent through the proxy against real vLLM, replays the recorded trace and
checks that every request's cached tokens are reproduced and that explain names every planted cause.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest
from kvscope.harness.analysis.explain import explain, explain_path, views_from_trace, volatile_at
from kvscope.harness.record.build import SessionAssigner, build_trace, finalize, read_exchanges_log
from kvscope.harness.record.proxy import EXCHANGES_LOG, RecordingProxy
from kvscope.harness.record.tokenize import LocalTokenize, RequestTokenizer
from kvscope.harness.results.exchanges import read_exchanges
from tests.doubles.scripted_agent import SYSTEM, TOOLS, source_file
from kvscope.workloads.trace import Trace

B = 16


@pytest.fixture(scope="module")
def template_file(tools_template_file) -> Path:
    return tools_template_file  # conftest's: the shared vLLM server renders chats with the same file


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir, template_file) -> RequestTokenizer:
    return RequestTokenizer(LocalTokenize(tiny_model_dir, template_file))


def _exchange(i: int, messages: list[dict], tools=None, session: str | None = "s1", cached: int | None = None,
              user: str | None = None) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": True}
    if tools is not None:
        body["tools"] = tools
    if user:
        body["user"] = user
    usage = {"prompt_tokens": None, "completion_tokens": 4}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"request_id": i, "api": "chat", "received_unix_s": 1000.0 + 10 * i, "first_byte_unix_s": 1000.5 + 10 * i,
            "done_unix_s": 1001.0 + 10 * i, "status": 200, "session_header": session,
            "request": body, "response": {"text": "ok", "tool_calls": [], "finish_reason": "length", "usage": usage},
            "error": None}


def _history(turns: int, now: str = "2026-12-01T09:00:00Z", task: str = "Fix the failing parser test.") -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM.format(now=now)}, {"role": "user", "content": task}]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": f"Reading file {chr(97 + t)}."})
        msgs.append({"role": "tool", "content": source_file(f"mod{chr(97 + t)}", 6)})
    return msgs


def _explain(tmp_path: Path, tokenizer: RequestTokenizer, exchanges: list[dict], observed: bool = False):
    out = build_trace(exchanges, tokenizer, tmp_path / "trace")
    trace = Trace.read(out)
    views = views_from_trace(trace, read_exchanges(out))
    obs = None
    if observed:
        obs = [e["response"]["usage"]["prompt_tokens_details"]["cached_tokens"] for e in exchanges]
    return explain(views, B, obs), trace


def _only_break(ex) -> tuple[str, int]:
    broken = [a for a in ex.requests if a.recomputed_tokens]
    assert len(broken) == 1, [(a.request_id, a.cause, a.recomputed_tokens) for a in ex.requests]
    return broken[0].cause, broken[0].request_id


# ------------------------------------------------------------------------------------------ explain, per cause


def test_timestamp_in_system_prompt_is_a_volatile_field(tmp_path, tokenizer):
    h = _history(2)
    ex, _ = _explain(tmp_path, tokenizer, [_exchange(0, h[:4], TOOLS), _exchange(1, h, TOOLS),
                                           _exchange(2, _history(2, now="2026-12-01T09:41:07Z"), TOOLS)])
    assert _only_break(ex) == ("volatile_field", 2)
    a = ex.requests[2]
    assert "message 0" in a.where and a.cached_tokens < a.prompt_tokens // 2
    # nothing but the timestamp changed: without it the recomputed tokens would have hit (within a block)
    assert ex.causes[0].cause == "volatile_field" and ex.causes[0].share == 1.0
    gained = ex.causes[0].what_if_hit_rate * ex.prompt_tokens - ex.cached_tokens
    assert abs(gained - ex.recomputed_tokens) <= B


def test_changed_system_prompt_without_a_volatile_value(tmp_path, tokenizer):
    h = _history(2)
    h2 = [{"role": "system", "content": h[0]["content"].replace("careful", "thorough")}, *h[1:]]
    ex, _ = _explain(tmp_path, tokenizer, [_exchange(0, h, TOOLS), _exchange(1, h2, TOOLS)])
    assert _only_break(ex) == ("system_prompt_changed", 1)


def test_reordered_tools_are_tools_changed(tmp_path, tokenizer):
    h = _history(2)
    ex, _ = _explain(tmp_path, tokenizer, [_exchange(0, h, TOOLS), _exchange(1, h + _history(3)[-2:], TOOLS[::-1]),
                                           _exchange(2, h + _history(3)[-2:] + [{"role": "user", "content": "go"}],
                                                     TOOLS[::-1])])
    assert _only_break(ex) == ("tools_changed", 1)
    assert ex.causes[0].what_if_hit_rate > ex.hit_rate  # the patch carries over to request 2


def test_edited_earlier_message(tmp_path, tokenizer):
    h = _history(3)
    h2 = [h[0], {"role": "user", "content": "Fix the failing parser test and keep the interface."}, *h[2:]]
    ex, _ = _explain(tmp_path, tokenizer, [_exchange(0, h, TOOLS), _exchange(1, h2, TOOLS)])
    assert _only_break(ex) == ("message_edited", 1)
    assert "message 1 (user)" in ex.requests[1].where
    # the predecessor's later messages are recomputed, the edited text itself is new
    assert ex.requests[1].recomputed_tokens > 0.6 * (ex.requests[1].prompt_tokens - ex.requests[1].cached_tokens)


def test_compaction_and_truncation(tmp_path, tokenizer):
    h = _history(3)
    summary = {"role": "user", "content": "Summary of the work so far: three modules were read.\n"}
    compacted = h[:2] + [summary] + h[-2:]
    truncated = h[:2] + h[-2:]  # the middle turns dropped, nothing new
    ex, _ = _explain(tmp_path, tokenizer, [_exchange(0, h, TOOLS), _exchange(1, compacted, TOOLS)])
    assert _only_break(ex) == ("compaction", 1)
    ex2, _ = _explain(tmp_path / "t", tokenizer, [_exchange(0, h, TOOLS), _exchange(1, truncated, TOOLS)])
    assert _only_break(ex2) == ("history_truncated", 1)


def test_a_missing_hit_on_an_unchanged_prefix_is_eviction(tmp_path, tokenizer):
    h = _history(2)
    ex, _ = _explain(tmp_path, tokenizer, [_exchange(0, h[:4], TOOLS, cached=0), _exchange(1, h, TOOLS, cached=0)],
                     observed=True)
    assert _only_break(ex) == ("evicted", 1)
    assert ex.causes[0].what_if_hit_rate > 0.3  # with an infinite cache the append hits


def test_append_only_session_has_nothing_recomputed(tmp_path, tokenizer):
    exchanges = [_exchange(i, _history(i), TOOLS) for i in range(4)]
    ex, trace = _explain(tmp_path, tokenizer, exchanges)
    assert all(a.recomputed_tokens == 0 for a in ex.requests) and ex.causes == []
    assert ex.cached_tokens > 0.5 * ex.prompt_tokens
    # one segment per message + the generation prompt; identical messages stored once
    assert len(trace.prompt_segment_ids(3)) == len(exchanges[3]["request"]["messages"]) + 1
    assert trace.num_segments < sum(len(trace.prompt_segment_ids(i)) for i in range(4))


def test_volatile_regexes():
    assert volatile_at("at 2026-12-01T09:00:00Z now", "at 2026-12-01T09:41:07Z now", 17) == "timestamp"
    assert volatile_at("id 123e4567-e89b-12d3-a456-426614174000", "id 123e4567-e89b-12d3-a456-426614174001", 38) \
        == "uuid"
    assert volatile_at("Fix the parser.", "Fix the parser and docs.", 14) is None


def test_segment_fallback_for_generated_traces(tiny_model_dir):
    from kvscope.workloads.generate import generate_from_file

    trace = generate_from_file("agent-coding-timestamped", tiny_model_dir, seed=1, scale=0.02, sessions=2,
                               max_context=1500)
    ex = explain(views_from_trace(trace), B)
    assert ex.causes and ex.causes[0].cause == "volatile_field" and ex.causes[0].share > 0.9


# ------------------------------------------------------------------------------------------ sessions, finalize


def test_sessions_from_header_user_field_or_longest_message_prefix():
    s = SessionAssigner()
    a, b = _history(1), _history(1, task="Another task entirely.")
    assert s.assign(_exchange(0, a, session="x")) == ("x", "header")
    assert s.assign(_exchange(0, a, session=None, user="u7")) == ("user:u7", "user")
    from kvscope.harness.record.build import _message_key, _Session

    first = s.assign(_exchange(0, a, session=None))
    s.sessions[first[0]] = _Session(first[0], [_message_key(m) for m in a], 0.0, 1, 0, 0.0)
    assert s.assign(_exchange(1, _history(2), session=None))[0] == first[0]  # extends a
    assert s.assign(_exchange(2, b, session=None))[0] != first[0]  # same system prompt only: a new session


def test_finalize_names_the_missing_tokenizer(tmp_path):
    (tmp_path / EXCHANGES_LOG).write_bytes(orjson.dumps(_exchange(0, _history(1))) + b"\n")
    from kvscope.harness.cli.main import main

    assert main(["record", "--finalize", str(tmp_path)]) == 2


def test_torn_final_line_is_dropped(tmp_path, tokenizer):
    lines = [orjson.dumps(_exchange(i, _history(i))) for i in range(3)]
    (tmp_path / EXCHANGES_LOG).write_bytes(b"\n".join(lines) + b"\n" + lines[0][:40])
    with pytest.warns(UserWarning, match="incomplete final record"):
        got = read_exchanges_log(tmp_path)
    assert len(got) == 3


# ------------------------------------------------------------------------------------------ proxy (fault server)


class _ProxyThread:
    def __init__(self, upstream: str, out: Path, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.new_event_loop()
        self.proxy = RecordingProxy(upstream, out)
        self.port = self.loop.run_until_complete(self.proxy.start("127.0.0.1", 0))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_proxy_forwards_streams_records_and_never_writes_the_key(tmp_path):
    import httpx
    from tests.doubles.faultserver import FaultConfig, FaultServer

    key = "sk-secret-value-123"
    with FaultServer(FaultConfig()) as srv:
        px = _ProxyThread(srv.endpoint, tmp_path)
        try:
            h = {"Authorization": f"Bearer {key}", "X-Session-ID": "sess-a"}
            body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
                    "tools": TOOLS, "tool_choice": "none", "x_unknown_field": {"kept": True}}
            with httpx.stream("POST", px.url + "/v1/chat/completions", json=body, headers=h) as r:
                events = [ln for ln in r.iter_lines() if ln.startswith("data:")]
            assert r.status_code == 200 and events[-1] == "data: [DONE]"
            # the proxy asked for usage; the client did not, so it gets no usage-only chunk
            assert not any('"usage"' in e and '"choices":[]' in e for e in events)
            comp = httpx.post(px.url + "/v1/completions", headers=h, json={
                "model": "mock", "prompt": [1, 2, 3], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}})
            assert '"usage"' in comp.text
            assert httpx.get(px.url + "/v1/models").json()["data"][0]["id"] == "mock"  # other paths forwarded
        finally:
            px.close()
    rows = [json.loads(x) for x in (tmp_path / EXCHANGES_LOG).read_text().splitlines()]
    assert [r["api"] for r in rows] == ["chat", "completions"]
    chat = rows[0]
    assert chat["session_header"] == "sess-a" and chat["request"]["x_unknown_field"] == {"kept": True}
    assert chat["request"]["tools"] == TOOLS and chat["response"]["usage"]["completion_tokens"] == 5
    assert chat["injected_include_usage"] and len(chat["response"]["text"]) > 0
    assert chat["first_byte_unix_s"] <= chat["done_unix_s"]
    for f in tmp_path.iterdir():
        assert key not in f.read_text(errors="replace"), f


def test_proxy_records_a_non_streaming_answer_with_tool_calls(tmp_path):
    import httpx
    from aiohttp import web

    answer = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 32}}}

    async def chat(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer k"  # forwarded
        return web.json_response(answer)

    async def upstream() -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    loop = asyncio.new_event_loop()
    runner, port = loop.run_until_complete(upstream())  # the upstream shares the proxy's loop and thread
    px = _ProxyThread(f"http://127.0.0.1:{port}", tmp_path, loop)
    try:
        r = httpx.post(px.url + "/v1/chat/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "alice"})
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        px.close()
    assert r.json() == answer
    (row,) = read_exchanges_log(tmp_path)
    assert row.response.tool_calls[0]["function"]["name"] == "read_file"
    assert row.response.usage.prompt_tokens_details.cached_tokens == 32
    assert not row.injected_include_usage and "Bearer k" not in (tmp_path / EXCHANGES_LOG).read_text()


def _held_stream_upstream(loop: asyncio.AbstractEventLoop, events: list[str], hold_s: float):
    """An upstream that streams ``events`` then holds its connection open ``hold_s`` before the end of stream."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(f"data: {e}\n\n".encode())
        await asyncio.sleep(hold_s)
        await resp.write_eof()
        return resp

    async def start() -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    return loop.run_until_complete(start())


@pytest.mark.parametrize("client_asks_usage", [True, False])
@pytest.mark.parametrize("read_to_done", [True, False])
def test_a_client_that_leaves_on_done_is_recorded_complete_and_one_that_leaves_before_is_not(
        tmp_path, client_asks_usage, read_to_done):
    """The openai SDK closes its connection on ``data: [DONE]``, which can come before the upstream's end of
    stream: the exchange is complete (it was counted as a client disconnect, so the trace lost a request)."""
    import time

    import httpx

    chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
    loop = asyncio.new_event_loop()
    events = [json.dumps(chunk), json.dumps(usage), "[DONE]"] if read_to_done else [json.dumps(chunk)]
    runner, port = _held_stream_upstream(loop, events, hold_s=30)
    px = _ProxyThread(f"http://127.0.0.1:{port}", tmp_path, loop)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if client_asks_usage:
        body["stream_options"] = {"include_usage": True}
    try:
        with httpx.stream("POST", px.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]" or (not read_to_done and line.startswith("data: {")):
                    break  # leave with the stream still open upstream
        deadline = time.monotonic() + 10
        while not (tmp_path / EXCHANGES_LOG).read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # the proxy notices the client left and logs the exchange
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        px.close()
    (row,) = read_exchanges_log(tmp_path)
    if read_to_done:
        assert row.status == 200 and row.error is None and row.done_unix_s is not None, row
        assert row.response.usage.completion_tokens == 1 and row.response.text == "ok"
    else:
        assert row.status != 200 and "closed the connection" in row.error, row


def test_proxy_answers_502_when_the_upstream_is_down(tmp_path):
    import httpx

    px = _ProxyThread("http://127.0.0.1:9", tmp_path)
    try:
        r = httpx.post(px.url + "/v1/chat/completions", json={"model": "m", "messages": []})
    finally:
        px.close()
    assert r.status_code == 502 and "upstream" in r.json()["error"]["message"]


def test_record_cli_records_until_sigint_then_writes_the_trace(tmp_path, tiny_model_dir, template_file):
    import signal

    import httpx

    from tests.doubles.faultserver import FaultConfig, FaultServer

    out = tmp_path / "rec"
    with FaultServer(FaultConfig()) as srv:
        proc = subprocess.Popen([sys.executable, "-m", "kvscope.harness.cli.main", "record", "--upstream", srv.endpoint,
                                 "--listen", "127.0.0.1:0", "--out", str(out), "--tokenizer", str(tiny_model_dir),
                                 "--chat-template", str(template_file)], stdout=subprocess.PIPE, text=True)
        try:
            url = proc.stdout.readline().split()[2]  # "recording on http://127.0.0.1:PORT -> ..."
            for turns in (1, 2):
                httpx.post(url + "/v1/chat/completions", timeout=30, json={
                    "model": "mock", "messages": _history(turns), "tools": TOOLS, "max_tokens": 4, "stream": True})
        finally:
            proc.send_signal(signal.SIGINT)
            stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "wrote trace" in stdout
    trace = Trace.read(out)
    assert trace.num_requests == 2 and trace.num_sessions == 1  # inferred: request 2 extends request 1
    assert trace.requests["think_time_s"].iloc[1] >= 0 and trace.requests["parent_request_id"].tolist() == [-1, 0]


def test_record_cli_rejects_bad_flags():
    from kvscope.harness.cli.main import main

    assert main(["record", "--upstream", "127.0.0.1:8000", "--out", "/tmp/x"]) == 2
    assert main(["record", "--upstream", "http://127.0.0.1:8000", "--out", "/tmp/x", "--listen", "nope"]) == 2


# ------------------------------------------------------------------------------------------ real vLLM


@pytest.mark.vllm
def test_scripted_agent_recorded_replayed_and_explained(vllm_server, template_file, tmp_path):
    """On conftest's shared server (it renders chats with the tool-aware template), from an empty prefix cache."""
    import httpx
    from kvscope.harness.results.records import read_records
    from tests.doubles.scripted_agent import ScriptedAgent

    server = vllm_server
    assert httpx.post(server.endpoint + "/reset_prefix_cache", timeout=30).status_code == 200
    out = tmp_path / "rec"
    px = _ProxyThread(server.endpoint, out)
    try:
        run = ScriptedAgent(px.url + "/v1", "tiny").run()
    finally:
        px.close()
    trace_dir = finalize(out, headers=px.proxy.auth_headers)
    block_size = server.facts().block_size
    assert Trace.read(trace_dir).meta["block_size_hint"] == block_size
    live = [u["prompt_tokens_details"]["cached_tokens"] for u in run.usages]
    trace = Trace.read(trace_dir)
    assert trace.num_requests == len(live) == 11 and trace.num_sessions == 1
    assert [len(trace.prompt_token_ids(i)) for i in range(trace.num_requests)] == \
        [u["prompt_tokens"] for u in run.usages]
    r = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "replay", str(trace_dir), "--endpoint",
                        server.endpoint, "--out", str(tmp_path / "run"), "--concurrency", "1", "--time-scale", "0",
                        "--no-progress"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr
    df = read_records(tmp_path / "run").sort_values("request_id")
    assert df["cached_tokens"].tolist() == live
    ex = explain_path(str(trace_dir))  # the block size recorded from the server
    planted = {i: c for i, c in enumerate(run.planted) if c}
    for a in ex.requests:
        if a.request_id in planted:
            assert a.cause == planted[a.request_id] and a.recomputed_tokens > 0, a
    on_planted = sum(a.recomputed_tokens for a in ex.requests if planted.get(a.request_id) == a.cause)
    assert ex.recomputed_tokens > 0 and on_planted >= 0.99 * ex.recomputed_tokens
    assert {c.cause for c in ex.causes} == set(planted.values())
    run_ex = explain_path(str(tmp_path / "run"))  # the replay run gives the same attribution
    assert [a.cause for a in run_ex.requests] == [a.cause for a in ex.requests]
    (tmp_path / "explain.txt").write_text(json.dumps(ex.to_json(), indent=1))


def test_claude_code_sample_shows_observed_cache_reads_beside_the_anthropic_model(shared_data, tiny_model_dir,
                                                                                 tmp_path):
    """The real Claude Code session: all 10 calls keep their usage, and explain puts Anthropic's observed
    cache reads beside the Anthropic cache model's prediction, as shares of each side's prompt."""
    from kvscope.harness.analysis.explain import explain_path
    from kvscope.harness.cli.record import provider_comparison_lines
    from kvscope.workloads.importers import import_claude_code

    sample = shared_data / "agent-traces/tracelab/example_sessions/claude/session.converted.jsonl"
    import_claude_code(sample, tiny_model_dir).write(tmp_path / "cc")
    ex = explain_path(str(tmp_path / "cc"))
    assert ex.provider_preset == "anthropic-sonnet-5m"  # chosen from the trace's observed usage
    observed = [a.provider_cached_tokens for a in ex.requests]
    assert observed[0] == 27217 and observed[-1] == 47506 and len(observed) == 10
    assert all(a.provider_prompt_tokens and a.provider_prompt_tokens > a.provider_cached_tokens for a in ex.requests)
    # the model sees only what this log holds: its reads grow call by call and never exceed the prompt
    model = [a.provider_predicted_cached_tokens for a in ex.requests]
    assert model == sorted(model) and all(m <= a.prompt_tokens for m, a in zip(model, ex.requests))
    lines = provider_comparison_lines(ex)
    assert lines[-1].startswith("agreement: mean |observed share - model share|")


def test_finalize_records_the_upstreams_block_size_in_trace_json(tmp_path, tiny_model_dir, template_file, monkeypatch):
    """The block-size hint goes into trace.json through its model (read, updated, validated, written)."""
    from kvscope.harness.record import build

    (tmp_path / EXCHANGES_LOG).write_bytes(orjson.dumps(_exchange(0, _history(1))) + b"\n")
    monkeypatch.setattr(build, "_upstream_block_size", lambda upstream, headers: 32)
    out = finalize(tmp_path, upstream="http://127.0.0.1:1", tokenizer_dir=str(tiny_model_dir),
                   chat_template=str(template_file))
    assert Trace.read(out).meta["block_size_hint"] == 32
