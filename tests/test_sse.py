"""The one SSE parser both streaming clients use: a stream split anywhere decodes to the same result, and the
fast and aiohttp clients built on it agree on every fault mode of the fault server."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvscope.harness.serving.client import AiohttpStreamClient, FastStreamClient, Timeouts, open_stream_client
from kvscope.harness.serving.request import CompletionResult, completion_payload
from kvscope.harness.serving.sse import SseDecoder
from tests.doubles.faultserver import FAULT_MODES, FaultServer

CHUNK = b'data: {"choices":[{"index":0,"text":"ab","token_ids":[%d, %d],"finish_reason":%s}]}\n\n'
CHAT = b'data:{"choices":[{"index":0,"delta":{"content":"hi"}}]}\r\n\r\n'
USAGE = (b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":7,'
         b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n')
STREAM = (b": keep-alive comment\n" + CHUNK % (1, 2, b"null") + CHAT + b"event: x\nid: 3\n"
          + CHUNK % (3, 4, b'"length"') + USAGE + b"data: [DONE]\n\n" + b"data: ignored after done\n\n")


def _decode(pieces: list[bytes]) -> tuple[CompletionResult, SseDecoder, bool]:
    res = CompletionResult(sent_s=0.0)
    dec = SseDecoder(res)
    ok = all(dec.feed(p, float(i)) for i, p in enumerate(pieces))
    return res, dec, ok


def test_decoder_folds_tokens_text_usage_and_done():
    res, dec, ok = _decode([STREAM])
    assert ok and dec.saw_done and res.ok
    assert res.token_ids == [1, 2, 3, 4] and res.chunk_tokens == [2, 1, 2] and res.text_chunks == 1
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (9, 7, 4)
    assert res.finish_reason == "length" and res.text_head == "abhiab"


@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_a_stream_split_anywhere_decodes_the_same(cuts):
    bounds = [0, *sorted(cuts), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in zip(bounds, bounds[1:])]
    res, dec, ok = _decode(pieces)
    whole, _, _ = _decode([STREAM])
    assert ok and dec.saw_done
    assert (res.token_ids, res.chunk_tokens, res.cached_tokens, res.text_head, res.finish_reason) == (
        whole.token_ids, whole.chunk_tokens, whole.cached_tokens, whole.text_head, whole.finish_reason)


@pytest.mark.parametrize("bad,error_class", [
    (b"data: {not json}\n", "malformed_stream"),
    (b"data: [1, 2]\n", "malformed_stream"),
    (b"HTTP/1.1 200 OK\n", "malformed_stream"),
    (b'data: {"error": {"message": "boom"}}\n', "server_error"),
])
def test_decoder_records_bad_streams(bad, error_class):
    res, dec, ok = _decode([CHUNK % (1, 2, b"null"), bad, USAGE])
    assert not ok and res.error_class == error_class and res.token_ids == [1, 2]


def test_open_stream_client_picks_the_transport():
    assert isinstance(open_stream_client("auto", "http://127.0.0.1:1/v1/completions"), FastStreamClient)
    assert isinstance(open_stream_client("auto", "https://example.invalid/v1/completions"), AiohttpStreamClient)
    assert isinstance(open_stream_client("aiohttp", "http://127.0.0.1:1/v1/completions"), AiohttpStreamClient)
    assert isinstance(open_stream_client("fast", "http://127.0.0.1:1/v1/completions"), FastStreamClient)


def test_both_clients_agree_on_every_fault_mode():
    body = orjson.dumps(completion_payload("m", [1, 2, 3], 8))
    # Limits well above any delay a busy 2-core host adds: with 0.5 s, a CI run beside real vLLM saw the fault
    # server's 200 headers arrive after the first-token limit for one client and not the other (stall_before).
    t = Timeouts(connect_s=2, first_token_s=2.0, idle_s=1.0, total_s=10)

    async def go():
        out = {}
        with FaultServer() as srv:
            url = srv.endpoint + "/v1/completions"
            for mode in FAULT_MODES:
                pair = []
                for kind in ("fast", "aiohttp"):
                    client = open_stream_client(kind, url, t)
                    try:
                        pair.append(await client.post_stream(url, body, headers={"X-Fault": mode}))
                    finally:
                        await client.close()
                out[mode] = pair
        return out

    for mode, (a, b) in asyncio.run(go()).items():
        assert (a.error_class, a.http_status, a.token_ids, a.cached_tokens) == (
            b.error_class, b.http_status, b.token_ids, b.cached_tokens), mode


def test_logprobs_are_summed_over_chunks_of_either_api():
    """A cascade's signal: vLLM's completions chunks carry ``logprobs.token_logprobs`` (one per token id), chat
    chunks ``logprobs.content[].logprob``; the mean is over every generated token, on both paths of the parser."""
    def chunk(ids, lps):
        return (b'data: ' + orjson.dumps({"choices": [{"index": 0, "text": "x", "token_ids": ids,
                                                        "logprobs": {"token_logprobs": lps}}]}) + b"\n\n")

    chat = b'data: ' + orjson.dumps({"choices": [{"index": 0, "delta": {"content": "y"},
                                                   "logprobs": {"content": [{"logprob": -4.0}]}}]}) + b"\n\n"
    r = CompletionResult(sent_s=0.0)
    SseDecoder(r).feed(chunk([1], [-1.0]) + chunk([2, 3], [-2.0, -3.0]) + chat + b"data: [DONE]\n\n", 1.0)
    assert (r.logprob_tokens, r.mean_logprob) == (4, -2.5)
    plain = CompletionResult(sent_s=0.0)
    SseDecoder(plain).feed(STREAM, 1.0)
    assert plain.mean_logprob is None
