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


# ------------------------------------------------------------------------------------------ full disk


@pytest.fixture(params=["ulimit -f", "tmpfs"])
def small_disk(request, tmp_path):
    """(where to record, a preexec_fn, the words of the error): the file size limit (`ulimit -f 64`, EFBIG),
    or, as root, a real 64 KB tmpfs (ENOSPC; the probe's setup)."""
    import os
    import resource

    if request.param == "ulimit -f":
        def small_files() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

        yield tmp_path / "rec", small_files, "file size limit reached writing"
        return
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt / "rec", None, "disk full writing"
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, check=False)


def test_a_proxy_that_cannot_record_says_so_once_and_answers_503(small_disk):
    """Probe: on a 64 KB tmpfs the proxy kept answering 200 (29 of 60 exchanges unrecorded), printed one aiohttp
    traceback per request and named "requests.jsonl". Also under the file size limit, which needs no root."""
    from tests.doubles.faultserver import FaultConfig, FaultServer

    out, preexec, words = small_disk
    with FaultServer(FaultConfig()) as srv:
        proc = subprocess.Popen([sys.executable, "-m", "kvscope.harness.cli.main", "record", "--upstream",
                                 srv.endpoint, "--listen", "127.0.0.1:0", "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=preexec)  # noqa: PLW1509 -- setrlimit only, before exec
        try:
            url = proc.stdout.readline().split()[2]
            statuses = []
            for i in range(60):
                r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
                    "model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": f"{i} " + "x" * 3000}]})
                statuses.append(r.status_code)
                if r.status_code == 503:
                    assert "exchanges.jsonl" in r.json()["error"]["message"]
            forwarded = srv.stats.completions
        finally:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
    ok = statuses.count(200)
    assert 0 < ok < 60 and statuses == [200] * ok + [503] * (60 - ok)  # 503 from the first failed write on
    assert forwarded == ok  # nothing was forwarded once the proxy could not record
    rows = read_exchanges_log(out)  # what was recorded stays readable: whole lines only
    assert [r.request_id for r in rows] == list(range(ok - 1))  # the one exchange in the failed write is named
    said = [line for line in err.splitlines() if "exchanges.jsonl" in line and "not recorded" in line]
    assert said and f"exchange {ok - 1} was answered but is not recorded" in said[0], err
    assert words in said[0] and "requests.jsonl" not in err
    assert "Traceback" not in err and proc.returncode == 2, err


# ------------------------------------------------------------------------------------------ content encoding


def _encoder(encoding: str):
    import zlib

    if encoding == "gzip":
        return zlib.compressobj(wbits=31)
    if encoding == "deflate":
        return zlib.compressobj(wbits=15)
    return zlib.compressobj(wbits=-15)  # raw deflate, as some servers send under "deflate"


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "raw-deflate"])
def test_an_encoded_upstream_response_is_decoded_forwarded_and_recorded(tmp_path, encoding, stream):
    """Probe: a gzip-encoded SSE stream was forwarded (without its Content-Encoding: unreadable to the client)
    and recorded as an empty response with no error."""
    import zlib

    from aiohttp import web

    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    header = "deflate" if encoding == "raw-deflate" else encoding

    async def handler(request):
        z = _encoder(encoding)
        if not (await request.json()).get("stream"):
            body = orjson.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                              "finish_reason": "stop"}], "usage": usage})
            return web.Response(body=z.compress(body) + z.flush(), content_type="application/json",
                                headers={"Content-Encoding": header})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Content-Encoding": header})
        await resp.prepare(request)
        for ev in (_chunk("Hel"), _chunk("lo", finish="stop"), _chunk(usage=usage)):
            await resp.write(z.compress(b"data: " + orjson.dumps(ev) + b"\n\n") + z.flush(zlib.Z_SYNC_FLUSH))
        await resp.write(z.compress(b"data: [DONE]\n\n") + z.flush())
        return resp

    up = _Upstream(handler)
    px = _Proxy(f"http://127.0.0.1:{up.port}", tmp_path)
    try:
        r = httpx.post(px.url + "/v1/chat/completions", timeout=30, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
    finally:
        px.close()
        up.close()
    assert r.status_code == 200 and "content-encoding" not in r.headers  # the client gets what it can read
    if stream:
        assert r.text.endswith("data: [DONE]\n\n") and '"usage"' not in r.text  # the injected usage event dropped
    else:
        assert r.json()["choices"][0]["message"]["content"] == "Hello"
    (row,) = read_exchanges_log(tmp_path)
    assert row.response.text == "Hello" and row.response.usage.model_dump(exclude_none=True) == usage and row.error is None
    assert up.seen_headers[0]["Accept-Encoding"].startswith("gzip, deflate")


def test_an_encoding_the_proxy_cannot_decode_is_forwarded_as_is_and_recorded_as_a_failure(tmp_path):
    from aiohttp import web

    payload = b"\x28\xb5\x2f\xfd opaque"

    async def handler(request):
        return web.Response(body=payload, content_type="application/json", headers={"Content-Encoding": "zstd-x"})

    up = _Upstream(handler)
    px = _Proxy(f"http://127.0.0.1:{up.port}", tmp_path)
    try:
        r = httpx.post(px.url + "/v1/chat/completions", timeout=30, headers={"Accept-Encoding": "identity"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    finally:
        px.close()
        up.close()
    assert r.status_code == 200 and r.headers["content-encoding"] == "zstd-x" and r.content == payload
    (row,) = read_exchanges_log(tmp_path)
    assert "Content-Encoding 'zstd-x' cannot be decoded" in row.error


def test_a_corrupt_gzip_stream_is_recorded_as_an_error_and_breaks_the_clients_stream(tmp_path):
    from aiohttp import web

    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Content-Encoding": "gzip"})
        await resp.prepare(request)
        await resp.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03 this is not deflate data")
        return resp

    up = _Upstream(handler)
    px = _Proxy(f"http://127.0.0.1:{up.port}", tmp_path)
    try:
        with pytest.raises(httpx.HTTPError):
            httpx.post(px.url + "/v1/chat/completions", timeout=30, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    finally:
        px.close()
        up.close()
    (row,) = read_exchanges_log(tmp_path)
    assert "ContentDecodeError" in row.error and row.done_unix_s is None


# ------------------------------------------------------------------------------------------ finalize, streamed


def _write_log(path: Path, rows: list[dict], extra: bytes = b"") -> None:
    (path / EXCHANGES_LOG).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows) + extra)


def test_finalize_refuses_an_exchange_over_the_cap_in_one_line(tmp_path, tiny_model_dir, template_file, capsys):
    """Probe: one 100 MB request took finalize past 17 GB (OOM-killed, nothing printed), and under a 6 GB limit
    it died with the tokenizer's PanicException traceback. An exchange over the cap is refused before any
    tokenizing, in one line naming it, the cap and the flag."""
    from kvscope.harness.cli.main import main

    rows = [_exchange(i, {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(2)]
    rows.append(_exchange(2, {"model": "m", "messages": [{"role": "user", "content": "x" * 200_000}]}))
    _write_log(tmp_path, rows)
    rc = main(["record", "--finalize", str(tmp_path), "--tokenizer", str(tiny_model_dir), "--chat-template",
               str(template_file), "--max-exchange-mib", "0.1", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "line 3 (exchange 2) is 0.2 MiB, over the 0.1 MiB" in err and "--max-exchange-mib" in err
    assert not (tmp_path / "trace.json").exists()


def test_the_default_cap_refuses_any_line_over_it_even_one_not_tokenized(tmp_path, tiny_model_dir):
    from kvscope.harness.record.build import MAX_EXCHANGE_MIB, ExchangeTooLargeError, finalize

    body = {"model": "m", "messages": [{"role": "user", "content": "y" * int(MAX_EXCHANGE_MIB * 2**20)}]}
    _write_log(tmp_path, [_exchange(0, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                          _exchange(1, body, status="interrupted", done=False)])
    with pytest.raises(ExchangeTooLargeError, match=f"line 2 \\(exchange 1\\) is 16.0 MiB, over the "
                                                    f"{MAX_EXCHANGE_MIB:g} MiB"):
        finalize(tmp_path, tokenizer_dir=str(tiny_model_dir))


def test_finalize_streams_to_the_same_trace_as_the_build_in_memory(tmp_path, local, tiny_model_dir, template_file,
                                                                    capsys):
    """The streamed finalize (an index, then one exchange at a time in arrival order) builds what the in-memory
    build does, from a log out of arrival order with a glued line and an incomplete exchange; with a progress
    bar on stderr."""
    from kvscope.harness.cli.main import main

    hist = [{"role": "system", "content": "You are an agent."}]
    rows = []
    for i in range(6):
        hist = hist + [{"role": "user", "content": f"step {i}"}]
        rows.append(_exchange(i, {"model": "m", "messages": hist, "tools": TOOLS}))
        hist = hist + [{"role": "assistant", "content": f"did {i}"}]
    rows.append(_exchange(6, {"model": "m", "messages": [{"role": "user", "content": "other"}]}, status=500))
    order = [3, 0, 6, 5, 1, 4, 2]  # appended out of arrival order (exchanges end in any order)
    glued = orjson.dumps(rows[2])[:30]  # a torn line an old proxy appended onto
    (tmp_path / "mem").mkdir()
    (tmp_path / "disk").mkdir()
    _write_log(tmp_path / "disk", [], b"".join(
        (glued if r == 4 else b"") + orjson.dumps(rows[r]) + b"\n" for r in order))
    with pytest.warns(UserWarning, match="torn record dropped"):
        rc = main(["record", "--finalize", str(tmp_path / "disk"), "--tokenizer", str(tiny_model_dir),
                   "--chat-template", str(template_file)])
    assert rc == 0
    streamed = Trace.read(tmp_path / "disk")
    assert "finalize: tokenize" in capsys.readouterr().err  # the progress bar
    in_memory = Trace.read(build_trace(rows, RequestTokenizer(local), tmp_path / "mem"))
    assert streamed.num_requests == in_memory.num_requests == 6
    assert streamed.meta["record"]["incomplete_exchanges"] == 1
    for col in ("session_id", "step", "parent_request_id", "arrival_s", "transition", "messages"):
        assert streamed.requests[col].tolist() == in_memory.requests[col].tolist(), col
    for i in range(6):
        assert streamed.prompt_token_ids(i).tolist() == in_memory.prompt_token_ids(i).tolist()


def test_a_tokenizer_panic_is_one_line_not_a_traceback(tmp_path, tiny_model_dir, template_file, monkeypatch,
                                                       capsys):
    """Probe: under a 6 GB address-space limit, finalize died with a PanicException traceback from the
    tokenizer's regex (pyo3's PanicException is a BaseException: no `except Exception` sees it)."""
    from kvscope.harness.cli.main import main

    class PanicException(BaseException):
        pass

    def panic(self, text, add_special_tokens=False):
        raise PanicException("called `Result::unwrap()` on an `Err` value: RegexError(CompiledTooBig)")

    monkeypatch.setattr(LocalTokenize, "__init__", _wrap_init_with(panic))
    _write_log(tmp_path, [_exchange(0, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})])
    rc = main(["record", "--finalize", str(tmp_path), "--tokenizer", str(tiny_model_dir), "--chat-template",
               str(template_file), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "the tokenizer failed on a 0.0 MiB prompt" in err, err


def _wrap_init_with(encode):
    init = LocalTokenize.__init__

    def patched(self, *a, **kw):
        init(self, *a, **kw)

        class Tok:
            def __init__(self, real):
                self.real = real

            def encode(self, text, add_special_tokens=False):
                return encode(self, text, add_special_tokens)

        self.tok = Tok(self.tok)

    return patched
