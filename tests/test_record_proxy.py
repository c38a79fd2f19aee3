"""`kvscope record` against hostile upstreams and real agent message shapes (issue #27's probes, one test each).

Upstreams are small aiohttp servers written here (CRLF/CR SSE framing, Basic auth, a stream held open) or the
project's fault server (stalls). Message shapes are the ones agent frameworks send: content parts, images,
``content: null`` with tool calls, parallel tool calls, reasoning, tool results as parts. Nothing here measures
time: "streamed, not buffered" is checked by holding the upstream's stream open until the client has seen the
first event.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvscope.harness.common.secrets import REDACTED, redact_credential_fields
from kvscope.harness.record.build import build_trace, read_exchanges_log
from kvscope.harness.record.proxy import EXCHANGES_LOG, RecordingProxy, SseEvents, split_url_credentials
from kvscope.harness.record.tokenize import (
    LocalTokenize,
    MessageShapeError,
    RequestTokenizer,
    template_messages,
)
from kvscope.harness.results.exchanges import read_exchanges
from kvscope.harness.serving.sse import SseLineSplitter
from tests.doubles.scripted_agent import TOOLS, TOOLS_TEMPLATE
from kvscope.workloads.trace import Trace


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tmpl") / "tools.jinja"
    p.write_text(TOOLS_TEMPLATE)
    return p


@pytest.fixture(scope="module")
def local(tiny_model_dir, template_file) -> LocalTokenize:
    return LocalTokenize(tiny_model_dir, template_file)


def _exchange(i: int, body: dict, status=200, done=True) -> dict:
    return {"request_id": i, "api": "chat", "received_unix_s": 1000.0 + i, "first_byte_unix_s": 1000.2 + i,
            "done_unix_s": 1000.5 + i if done else None, "status": status, "session_header": None,
            "request": body, "response": {"text": "ok", "tool_calls": [], "finish_reason": "stop",
                                          "usage": {"prompt_tokens": 10, "completion_tokens": 2}},
            "error": None}


CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
CALL2 = {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"pattern": "x"}'}}
AGENT_SHAPES = [
    {"role": "system", "content": [{"type": "text", "text": "You are an agent."}]},
    {"role": "user", "content": [{"type": "text", "text": "look at"}, {"type": "image_url",
                                                                      "image_url": {"url": "data:image/png;base64,AA"}},
                                 {"type": "text", "text": "this"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL, CALL2], "reasoning": "two reads"},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "print(1)"}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "no match"},
    {"role": "assistant", "content": [{"type": "text", "text": "done"}], "tool_calls": []},
    {"role": "user", "content": "thanks", "name": "dev"},
]


# ------------------------------------------------------------------------------------------ message shapes


def test_template_messages_follow_vllm_rules():
    got = template_messages(AGENT_SHAPES)
    assert got[0]["content"] == "You are an agent."
    assert got[1]["content"] == "<image>\nlook at\nthis"  # media placeholder first, texts joined with \n
    assert got[2]["content"] == "" and got[2]["reasoning"] == got[2]["reasoning_content"] == "two reads"
    assert [c["function"]["arguments"] for c in got[2]["tool_calls"]] == [{"path": "a.py"}, {"pattern": "x"}]
    assert got[3] == {"role": "tool", "content": "print(1)", "tool_call_id": "call_1"}
    assert "tool_calls" not in got[5]  # an empty list is dropped, as vLLM does
    assert got[6]["name"] == "dev"
    bad = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}
    assert template_messages([bad])[0]["tool_calls"][0]["function"]["arguments"] == {}
    for shape in ("hello", [1], [{"content": "no role"}], [{"role": "user", "content": 3}]):
        with pytest.raises(MessageShapeError):
            template_messages(shape)


def test_content_parts_render_like_the_joined_string(local):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    joined = [{"role": "user", "content": "a\nb"}]
    assert local.chat(None, parts, {}, True) == local.chat(None, joined, {}, True)
    with_null = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    text = local.tok.decode(local.chat(None, with_null, {}, False), skip_special_tokens=False)
    assert 'read_file {"path": "a.py"}' in text  # arguments rendered as an object, as vLLM passes them


def test_finalize_survives_every_agent_message_shape(tmp_path, local):
    """Probe: list content, null content with tool calls, `"messages": "hello"` (answered 200 upstream)."""
    bodies = [{"model": "m", "messages": AGENT_SHAPES[:k], "tools": TOOLS} for k in (2, 5, 7)]
    rows = [_exchange(i, b) for i, b in enumerate(bodies)]
    rows.append(_exchange(3, {"model": "m", "messages": "hello"}))
    rows.append(_exchange(4, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, status="interrupted",
                          done=False))
    (tmp_path / EXCHANGES_LOG).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    with pytest.warns(UserWarning, match="1 exchange"):
        out = build_trace(read_exchanges_log(tmp_path), RequestTokenizer(local), tmp_path)
    trace = Trace.read(out)
    assert trace.num_requests == 3 and trace.num_sessions == 1
    assert trace.meta["record"]["skipped_exchanges"] == 1 and trace.meta["record"]["incomplete_exchanges"] == 1
    assert trace.requests["transition"].tolist() == ["first", "append", "append"]
    for i, body in enumerate(bodies):  # the trace's prompt is exactly the rendering of the body
        assert trace.prompt_token_ids(i).tolist() == local.chat(None, body["messages"], {"tools": TOOLS}, True)


# ------------------------------------------------------------------------------------------ SSE framing


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([b"data: a", b"data: {\"x\": 1}", b"", b": c", b"event: e"]), max_size=12),
       st.sampled_from([b"\n", b"\r\n", b"\r"]), st.lists(st.integers(1, 7), min_size=1, max_size=40))
def test_line_splitter_is_framing_and_chunking_independent(lines, eol, cuts):
    stream = b"".join(line + eol for line in lines)
    splitter, got, pos, k = SseLineSplitter(), [], 0, 0
    while pos < len(stream):
        n = cuts[k % len(cuts)]
        got += splitter.feed(stream[pos:pos + n])
        pos, k = pos + n, k + 1
    assert got == lines and splitter.tail == b""


def test_sse_events_join_multiline_data_and_keep_the_terminator():
    ev = SseEvents()
    got = ev.feed(b"data: {\"a\":\r\ndata: 1}\r\n\r\ndata: [DONE]\r\n\r\n")
    assert [p for p, _ in got] == [b'{"a":\n1}', b"[DONE]"] and ev.terminator == b"\r\n"


class _Upstream:
    """An aiohttp upstream on its own loop and thread; `handler(request)` is the chat endpoint."""

    def __init__(self, handler) -> None:
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        self.seen_headers: list[dict[str, str]] = []

        async def chat(request):
            self.seen_headers.append(dict(request.headers))
            return await handler(request)

        async def start():
            app = web.Application()
            app.router.add_post("/v1/chat/completions", chat)
            self.runner = web.AppRunner(app, shutdown_timeout=0.5)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        self.port = self.loop.run_until_complete(start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class _Proxy:
    def __init__(self, upstream: str, out: Path, **kw) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxy = RecordingProxy(upstream, out, **kw)
        self.port = self.loop.run_until_complete(self.proxy.start("127.0.0.1", 0))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _chunk(content=None, usage=None, finish=None) -> dict:
    choices = [] if content is None and finish is None else [
        {"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]
    return {"id": "x", "object": "chat.completion.chunk", "choices": choices, **({"usage": usage} if usage else {})}


@pytest.mark.parametrize("eol", [b"\r\n", b"\r", b"\n"])
def test_sse_framings_stream_through_event_by_event(tmp_path, eol):
    """Probe: `\\r\\n\\r\\n` framing (sse-starlette) was buffered, leaked the injected usage chunk, recorded nothing."""
    from aiohttp import web

    release = threading.Event()
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}

    async def handler(request):
        asked = (await request.json()).get("stream_options", {}).get("include_usage")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + orjson.dumps(_chunk("Hel")) + eol + eol)
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 20)  # held until the client saw it
        await resp.write(b"data: " + orjson.dumps(_chunk("lo", finish="stop")) + eol + eol)
        if asked:
            await resp.write(b"data: " + orjson.dumps(_chunk(usage=usage)) + eol + eol)
        await resp.write(b"data: [DONE]" + eol + eol)
        return resp

    up = _Upstream(handler)
    px = _Proxy(f"http://127.0.0.1:{up.port}", tmp_path)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        received = b""
        with httpx.stream("POST", px.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for piece in r.iter_raw():
                received += piece
                if b"Hel" in received:
                    release.set()  # the first event arrived while the upstream still held the stream
        assert release.is_set()
    finally:
        release.set()
        px.close()
        up.close()
    assert b'"usage"' not in received  # the client did not ask for usage
    assert received.count(eol + eol) == 3 and received.endswith(b"data: [DONE]" + eol + eol)
    (row,) = read_exchanges_log(tmp_path)
    assert row.response.text == "Hello" and row.response.usage.model_dump(exclude_unset=True) == usage
    assert row.status == 200 and row.response.finish_reason == "stop"


# ------------------------------------------------------------------------------------------ shutdown


def _wait_for(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def _stalled_request(url: str, done: list) -> threading.Thread:
    def go():
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", headers={"X-Fault": "stall_mid"}, timeout=60,
                              json={"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 8, "stream": True}) as r:
                for _ in r.iter_raw():
                    pass
        except httpx.HTTPError as exc:
            done.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_shutdown_drains_then_records_stalled_exchanges_as_interrupted(tmp_path):
    from tests.doubles.faultserver import FaultConfig, FaultServer

    with FaultServer(FaultConfig()) as srv:
        px = _Proxy(srv.endpoint, tmp_path)
        errors: list = []
        t = _stalled_request(px.url, errors)
        _wait_for(lambda: px.proxy.in_flight == 1)
        drained: list[int] = []
        n = px.call(px.proxy.shutdown(drain_s=0.1, on_drain=drained.append))
        px.loop.call_soon_threadsafe(px.loop.stop)
        px.thread.join(10)
        t.join(30)
    assert n == 1 and drained == [1] and not t.is_alive() and errors  # the client saw a broken stream
    (row,) = read_exchanges_log(tmp_path)
    assert row.status == "interrupted" and row.done_unix_s is None and row.first_byte_unix_s
    assert len(row.response.text) > 0  # what streamed before the stall is kept


def test_a_client_leaving_a_stalled_stream_closes_the_handler(tmp_path):
    from tests.doubles.faultserver import FaultConfig, FaultServer

    with FaultServer(FaultConfig()) as srv:
        px = _Proxy(srv.endpoint, tmp_path)
        try:
            with httpx.stream("POST", px.url + "/v1/chat/completions", headers={"X-Fault": "stall_mid"}, timeout=30,
                              json={"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 8, "stream": True}) as r:
                next(r.iter_raw())
            _wait_for(lambda: px.proxy.in_flight == 0)
            assert px.proxy._session.connector._acquired == set()  # the upstream connection was released
        finally:
            px.close()
    (row,) = read_exchanges_log(tmp_path)
    assert row.status == "client_disconnected"


def _record_cli(upstream: str, out: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.harness.cli.main", "record", "--upstream", upstream,
                             "--listen", "127.0.0.1:0", "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    banner = proc.stdout.readline()
    return proc, banner


@pytest.mark.parametrize("signals", [["SIGINT"], ["SIGTERM"], ["SIGINT", "SIGINT"]])
def test_cli_stop_with_a_stalled_stream(tmp_path, tiny_model_dir, template_file, signals):
    """Probe: Ctrl-C with a stalled stream took 66-126 s, a second Ctrl-C and SIGTERM were ignored, the stalled
    exchange was lost. One signal: a bounded drain, the stalled exchange recorded as interrupted, the trace
    written. Two: the second ends the (60 s) drain at once."""
    from tests.doubles.faultserver import FaultConfig, FaultServer

    out = tmp_path / "rec"
    drain = "60" if len(signals) == 2 else "0.5"
    with FaultServer(FaultConfig()) as srv:
        proc, banner = _record_cli(srv.endpoint, out, "--tokenizer", str(tiny_model_dir), "--chat-template",
                                   str(template_file), "--drain-s", drain)
        try:
            url = banner.split()[2]
            httpx.post(url + "/v1/chat/completions", timeout=30, json={
                "model": "mock", "messages": [{"role": "user", "content": "first"}], "max_tokens": 4})
            errors: list = []
            t = _stalled_request(url, errors)
            _wait_for(lambda: srv.stats.completions == 2)  # the stalled request is in flight in the proxy
            proc.send_signal(getattr(signal, signals[0]))
            assert f"waiting up to {drain} s for 1 exchange" in proc.stderr.readline()
            if len(signals) == 2:
                proc.send_signal(signal.SIGINT)
            stdout, err = proc.communicate(timeout=120)
            t.join(30)
        finally:
            if proc.poll() is None:
                proc.kill()
    rows = read_exchanges_log(out)
    assert [r.status for r in rows] == [200, "interrupted"]
    assert "1 exchange(s) in flight recorded as interrupted" in err
    if len(signals) == 2:
        assert proc.returncode == 130 and f"--finalize {out}" in err
    else:
        assert proc.returncode == 0 and "wrote trace" in stdout, err
        assert Trace.read(out).meta["record"]["incomplete_exchanges"] == 1


# ------------------------------------------------------------------------------------------ log reopen


def test_restart_on_a_torn_log_keeps_it_readable(tmp_path):
    """Probe: restarting on a torn exchanges.jsonl appended onto the partial line ("not a JSON record")."""
    from tests.doubles.faultserver import FaultConfig, FaultServer

    whole = [orjson.dumps(_exchange(i, {"model": "m", "messages": [{"role": "user", "content": str(i)}]}))
             for i in range(2)]
    (tmp_path / EXCHANGES_LOG).write_bytes(b"\n".join(whole) + b"\n" + whole[0][:30])
    with FaultServer(FaultConfig()) as srv:
        with pytest.warns(UserWarning, match="torn last line"):
            px = _Proxy(srv.endpoint, tmp_path)
        try:
            r = httpx.post(px.url + "/v1/chat/completions", timeout=30, json={
                "model": "mock", "messages": [{"role": "user", "content": "after restart"}], "max_tokens": 3})
            assert r.status_code == 200
        finally:
            px.close()
    raw = (tmp_path / EXCHANGES_LOG).read_bytes()
    rows = [orjson.loads(line) for line in raw.splitlines()]  # every line is a whole record
    assert [r["request_id"] for r in rows] == [0, 1, 2]
    assert rows[2]["request"]["messages"][0]["content"] == "after restart"


def test_a_log_glued_by_an_old_proxy_loses_only_the_torn_record(tmp_path):
    rows = [orjson.dumps(_exchange(i, {"model": "m", "messages": [{"role": "user", "content": str(i)}]}))
            for i in range(3)]
    (tmp_path / EXCHANGES_LOG).write_bytes(rows[0] + b"\n" + rows[1][:25] + rows[2] + b"\n")
    with pytest.warns(UserWarning, match="the record after it kept"):
        got = read_exchanges_log(tmp_path)
    assert [r.request_id for r in got] == [0, 2]


# ------------------------------------------------------------------------------------------ credentials


def test_url_credentials_become_a_header_and_are_never_printed(tmp_path):
    """Probe: `--upstream http://u:p@host` printed the password, and requests carrying Authorization got a 500."""
    from aiohttp import web

    async def handler(request):
        body = await request.json()
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}, "echo_model": body["model"]})

    up = _Upstream(handler)
    out = tmp_path / "rec"
    password = "s3cr3t-pa55"
    try:
        proc, banner = _record_cli(f"http://user:{password}@127.0.0.1:{up.port}", out)
        try:
            url = banner.split()[2]
            r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-client"}, timeout=30,
                           json={"model": "m", "api_key": "sk-in-body-123", "messages": [{"role": "user",
                                                                                         "content": "hi"}]})
            assert r.status_code == 200 and r.json()["echo_model"] == "m"
        finally:
            proc.send_signal(signal.SIGINT)
            stdout, err = proc.communicate(timeout=60)
    finally:
        up.close()
    assert password not in banner + stdout + err
    expected = "Basic " + base64.b64encode(f"user:{password}".encode()).decode()
    assert up.seen_headers[0]["Authorization"] == expected
    for f in out.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert password.encode() not in data and b"sk-in-body-123" not in data and b"sk-client" not in data, f
    (row,) = read_exchanges_log(out)
    assert row.request["api_key"] == REDACTED


def test_client_credentials_are_kept_in_memory_for_finalize_whatever_their_case(tmp_path):
    from aiohttp import web

    async def handler(request):
        return web.json_response({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 0}})

    up = _Upstream(handler)
    px = _Proxy(f"http://127.0.0.1:{up.port}", tmp_path)
    try:
        for key in ("sk-one", "sk-two"):
            httpx.post(px.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert px.proxy.auth_headers == {"Authorization": "Bearer sk-two"}  # /tokenize at finalize uses it
    finally:
        px.close()
        up.close()
    assert b"sk-" not in (tmp_path / EXCHANGES_LOG).read_bytes()


def test_split_url_credentials_and_body_redaction():
    url, headers = split_url_credentials("https://a%40b:p%3Aw@host.example:8443/base")
    assert url == "https://host.example:8443/base"
    assert base64.b64decode(headers["Authorization"].split()[1]) == b"a@b:p:w"
    assert split_url_credentials("http://h:1") == ("http://h:1", {})
    body = {"model": "m", "max_tokens": 5, "api_key": "k", "extra": {"apiKey": "k", "auth_token": "t"},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "properties": {"key": {"type": "string"}}}}}]}
    red = redact_credential_fields(body)
    assert red["api_key"] == red["extra"]["apiKey"] == red["extra"]["auth_token"] == REDACTED
    assert red["max_tokens"] == 5 and red["tools"] == body["tools"]


def test_exchanges_parquet_has_no_body_credentials(tmp_path, local):
    body = {"model": "m", "api_key": "sk-body", "messages": [{"role": "user", "content": "hi"}]}
    ex = _exchange(0, redact_credential_fields(body))
    out = build_trace([ex], RequestTokenizer(local), tmp_path)
    params = json.loads(read_exchanges(out)["params_json"].iloc[0])
    assert params["api_key"] == REDACTED


# ------------------------------------------------------------------------------------------ real frameworks, real vLLM


@pytest.mark.vllm
def test_agent_frameworks_are_recorded_exactly(require_vllm, tiny_model_dir, tmp_path):
    """openai-agents, LangGraph, Pydantic AI and smolagents tool-calling loops (installed in their own venv,
    named by KVSCOPE_AGENTS_VENV; skipped without it: minutes of CPU, a validation run rather than CI) through the proxy, no session header:
    nothing lost, the trace's prompts and the recorded usage equal vLLM's, a sequential replay reproduces the live
    cached tokens request by request, and explain names a cause for >= 95 % of the recomputed tokens."""
    import os

    from benchmarks.record_agents import SCRIPTS, run_framework, start_tool_server

    venv = Path(os.environ.get("KVSCOPE_AGENTS_VENV") or "/nonexistent")
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no agent-framework venv at {venv} (benchmarks/record_agents.py says how to make one)")
    server, template = start_tool_server(tiny_model_dir, tmp_path)
    try:
        results = [run_framework(name, server.endpoint, tiny_model_dir, template, venv, tmp_path, 3)
                   for name in SCRIPTS]
    finally:
        server.stop()
    for r in results:
        assert r["agent_rc"] == 0, r
        assert r["exchanges_ok"] >= 2 and r["exchanges_lost"] == 0 and r["interrupted"] == 0, r
        assert r["prompt_mismatch_requests"] == 0, r
        assert r["prompt_tokens_trace"] == r["prompt_tokens_usage"] == r["prompt_tokens_vllm"], r
        assert r["completion_tokens_usage"] == r["completion_tokens_vllm"], r
        assert r["replay_cached_tokens"] == r["live_cached_tokens"], r
        assert r["explained_share"] >= 0.95, r
    assert sum(r["tool_call_answers"] for r in results) >= len(results)  # the loops really called tools
    assert any(r["streamed"] for r in results) and any(r["streamed"] < r["exchanges_ok"] for r in results)
