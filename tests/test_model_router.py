"""Model routing live, on two mock servers (tests/doubles/faultserver.py): the router sends each request to its
model's endpoint, a cascade re-sends a failed small answer's prompt to the large model and records it once
(model, reason, escalation, the wasted small attempt's tokens and times), stickiness keeps an escalated session
on the large model, and routing.json holds the offline model's check.  Bad input is one line and exit 2 before
anything is sent.  The real two-vLLM replay is tests/test_model_router_vllm.py."""

from __future__ import annotations

import pytest
import yaml
from kvscope.harness.cli.main import main
from kvscope.harness.results.records import read_records
from kvscope.harness.results.routing_file import load_routing_file
from kvscope.workloads.generate import synthetic_trace

from tests.doubles.faultserver import FaultConfig, FaultServer

MODELS = [{"name": "small"}, {"name": "large"}]


def _trace(tmp_path):
    return synthetic_trace(3, steps=3, prompt_tokens=40, output_tokens=3).write(tmp_path / "trace")


def _spec(tmp_path, policy: dict, stickiness: str = "per-step", models=MODELS) -> str:
    p = tmp_path / f"routing-{len(list(tmp_path.glob('routing-*')))}.yaml"
    p.write_text(yaml.safe_dump({"models": models, "policy": policy, "stickiness": stickiness}))
    return str(p)


def _labels(tmp_path, failed: set[int], n: int = 9, name: str = "labels.csv") -> str:
    p = tmp_path / name
    p.write_text("request_id,passed\n" + "".join(f"{i},{'fail' if i in failed else 'pass'}\n" for i in range(n)))
    return str(p)


def _replay(tmp_path, endpoints: list[str], spec: str, *extra: str, out: str = "run") -> int:
    args = ["replay", str(_trace(tmp_path)) if not (tmp_path / "trace").exists() else str(tmp_path / "trace"),
            "--out", str(tmp_path / out), "--model-routing", spec, "--concurrency", "1", "--time-scale", "0",
            "--no-progress", *extra]
    for ep in endpoints:
        args += ["--endpoint", ep]
    return main(args)


@pytest.mark.parametrize("stickiness", ["per-step", "sticky-after-escalation"])
def test_a_label_cascade_escalates_the_failed_requests_and_records_the_wasted_attempt(tmp_path, capsys, stickiness):
    failed = {1, 3}  # session 0's step 1 and session 1's step 0
    with FaultServer(FaultConfig(model="small-m")) as small, FaultServer(FaultConfig(model="large-m")) as large:
        spec = _spec(tmp_path, {"kind": "cascade", "label_column": "passed"}, stickiness)
        rc = _replay(tmp_path, [small.endpoint, large.endpoint], spec, "--labels", _labels(tmp_path, failed))
        small_seen, large_seen = small.stats.completions, large.stats.completions
    out = capsys.readouterr().out
    assert rc == 0
    recs = read_records(tmp_path / "run").set_index("request_id").sort_index()
    assert len(recs) == 9  # one record per request, escalated or not
    sticky = stickiness == "sticky-after-escalation"
    # sticky: the sessions stay on the large model after their escalation (request 2 after 1; 4, 5 after 3)
    on_large = failed | ({2, 4, 5} if sticky else set())
    assert set(recs.index[recs["model"] == "large"]) == on_large
    assert set(recs.index[recs["escalated"]]) == failed
    assert (recs.loc[sorted(on_large), "endpoint_index"] == 1).all()
    esc = recs.loc[sorted(failed)]
    assert (esc["wasted_model"] == "small").all() and (esc["wasted_output_tokens"] == 3).all()
    assert (esc["wasted_sent_s"] < esc["wasted_done_s"]).all() and (esc["wasted_done_s"] <= esc["sent_s"]).all()
    assert esc["route_reason"].str.startswith("escalated: failed passed='fail'").all()
    if sticky:
        assert recs.loc[5, "route_reason"] == "sticky: session on large since step 0"
    assert recs.loc[0, "route_reason"] == "cascade: small answer passed" and recs.loc[0, "model"] == "small"
    # the servers saw every small attempt and the large requests once each
    assert small_seen == 9 - (len(on_large) - len(failed)) and large_seen == len(on_large)
    check = load_routing_file(tmp_path / "run" / "routing.json")
    assert check.requests == 9 and check.escalations == 2
    assert check.exact_share == 1.0 and check.exact_share_all_attempts == 1.0  # no shared prefixes: 0 = 0
    assert "model routing: " in out and "2 escalated" in out


def test_a_logprob_cascade_asks_the_small_model_for_logprobs_only(tmp_path):
    """The mock returns no logprobs, so nothing escalates; what matters here is the request bodies."""
    with FaultServer(FaultConfig(model="s", keep_bodies=True)) as small, \
            FaultServer(FaultConfig(model="l", keep_bodies=True)) as large:
        spec = _spec(tmp_path, {"kind": "cascade", "min_mean_logprob": -2.0, "max_output_tokens": 2})
        assert _replay(tmp_path, [small.endpoint, large.endpoint], spec) == 0
    recs = read_records(tmp_path / "run")
    assert recs["escalated"].all()  # 3 planned output tokens > 2: every request fails the length check
    assert recs["mean_logprob"].isna().all()
    assert len(small.bodies) == len(large.bodies) == 9
    assert all(b["logprobs"] == 1 and b["model"] == "s" for b in small.bodies)
    assert all("logprobs" not in b and b["model"] == "l" for b in large.bodies)


def test_the_length_check_reads_the_small_answer_as_it_came(tmp_path):
    """Planned outputs are 3 tokens; the small server answers 6 (it ignores max_tokens): live, the check sees 6."""
    with FaultServer(FaultConfig(model="s", output_len=6)) as small, FaultServer(FaultConfig(model="l")) as large:
        spec = _spec(tmp_path, {"kind": "cascade", "max_output_tokens": 4})
        assert _replay(tmp_path, [small.endpoint, large.endpoint], spec) == 0
    recs = read_records(tmp_path / "run")
    assert recs["escalated"].all() and (recs["wasted_output_tokens"] == 6).all() and (recs["output_tokens"] == 3).all()
    assert recs["route_reason"].str.contains("output 6>4 tokens").all()


BAD = [
    ({"kind": "rule", "rules": [{"model": "huge"}]}, None, "policy names unknown model 'huge'"),
    ({"kind": "cascade", "min_mean_logprob": 0.5}, None, "min_mean_logprob"),
    ({"kind": "cascade", "max_output_tokens": 0}, None, "max_output_tokens"),
    ({"kind": "cascade", "label_column": "passed"}, "extra", "labels must match the trace's requests"),
    ({"kind": "cascade", "label_column": "passed"}, "missing", "labels must match the trace's requests"),
    ({"kind": "cascade", "label_column": "verdict"}, "ok", "reads column 'verdict'"),
    ({"kind": "all-large"}, "three-endpoints", "3 endpoint(s) for 2 models"),
]


@pytest.mark.parametrize("policy,labels,message", BAD)
def test_bad_routing_input_is_one_line_and_exit_2_before_anything_is_sent(tmp_path, capsys, policy, labels,
                                                                           message):
    _trace(tmp_path)
    endpoints = ["http://127.0.0.1:9", "http://127.0.0.1:10"]  # nothing listens: nothing may be sent
    extra: list[str] = []
    if labels == "extra":
        extra = ["--labels", _labels(tmp_path, set(), n=10)]
    elif labels == "missing":
        extra = ["--labels", _labels(tmp_path, set(), n=8)]
    elif labels == "ok":
        extra = ["--labels", _labels(tmp_path, set())]
    elif labels == "three-endpoints":
        endpoints.append("http://127.0.0.1:11")
    spec = _spec(tmp_path, policy)
    rc = _replay(tmp_path, endpoints, spec, *extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run" / "requests.jsonl").exists() or not (tmp_path / "run" / "requests.jsonl").read_text()


def test_routing_flags_without_a_routing_spec_are_refused(tmp_path, capsys):
    _trace(tmp_path)
    rc = main(["replay", str(tmp_path / "trace"), "--endpoint", "http://127.0.0.1:9", "--out", str(tmp_path / "r"),
               "--labels", _labels(tmp_path, set())])
    assert rc == 2 and "--labels needs --model-routing" in capsys.readouterr().err


def test_routing_needs_endpoints_and_the_sequential_pools(tmp_path, capsys):
    """A launched --server is one model, and the scheduler model's calibration is one server's: both refused."""
    _trace(tmp_path)
    spec = _spec(tmp_path, {"kind": "all-small"})
    (tmp_path / "server.yaml").write_text("model: /nowhere\n")
    rc = main(["replay", str(tmp_path / "trace"), "--server", str(tmp_path / "server.yaml"), "--out",
               str(tmp_path / "r1"), "--model-routing", spec])
    assert rc == 2 and "--model-routing needs one --endpoint per model" in capsys.readouterr().err
    rc = _replay(tmp_path, ["http://127.0.0.1:9", "http://127.0.0.1:10"], spec, "--calibrate", out="r2")
    err = capsys.readouterr().err
    assert rc == 2 and "--calibration / --calibrate" in err and len(err.strip().splitlines()) == 1
