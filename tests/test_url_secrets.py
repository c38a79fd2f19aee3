"""Credentials in an endpoint URL never reach a file or the terminal, in every command that takes a URL
(issue 40, item 6): `kvscope replay --endpoint http://bob:PW@host:port` wrote the password to summary.json
and manifest.json and printed it in errors; `server-info` printed it, and a `?api_key=` query parameter, in
its error and in `--json`.

Each command runs as a subprocess (what a user sees is stdout and stderr) against the in-process mock server
(tests/doubles/faultserver.py) set to refuse every request without the `Authorization` header the URL's
credentials stand for: userinfo is basic auth, a lone userinfo token or an `api_key` query parameter a bearer
token. So a passing command proves the credentials were sent as a header, and the check that the secret is in
no file under its output and in neither stream proves they were taken out everywhere else.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvscope.harness.common.secrets import split_url_credentials
from kvscope.workloads.generate import synthetic_trace
from tests.cli import kvscope

from tests.doubles.faultserver import FaultConfig, FaultServer

REPO = Path(__file__).resolve().parents[1]
PASSWORD = "pw-Zq81xK"
TOKEN = "sk-query-7Hn2Lp"


def _forms(port: int) -> list[tuple[str, str, str]]:
    """(URL, the Authorization header its credentials stand for, the secret that must never show)."""
    basic = "Basic " + base64.b64encode(f"bob:{PASSWORD}".encode()).decode()
    return [(f"http://bob:{PASSWORD}@127.0.0.1:{port}", basic, PASSWORD),
            (f"http://127.0.0.1:{port}/v1?api_key={TOKEN}", f"Bearer {TOKEN}", TOKEN),
            (f"http://{TOKEN}@127.0.0.1:{port}", f"Bearer {TOKEN}", TOKEN)]


FORMS = ["userinfo", "query", "token-userinfo"]


def _kvscope(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return kvscope(*args, cwd=REPO, timeout=timeout)


def _assert_nowhere(secret: str, proc: subprocess.CompletedProcess, *roots: Path) -> None:
    assert secret not in proc.stdout and secret not in proc.stderr, (proc.stdout[-2000:], proc.stderr[-2000:])
    b64 = base64.b64encode(f"bob:{secret}".encode()).decode()
    for root in roots:
        for f in root.rglob("*"):
            if f.is_file():
                data = f.read_bytes()
                assert secret.encode() not in data and b64.encode() not in data, f


@pytest.fixture()
def authed_server(request):
    """The mock server; its required header is set per form by the test."""
    with FaultServer(FaultConfig(ttft_s=0.002, itl_s=0.001, output_len=4, max_model_len=1024,
                                 num_gpu_blocks=256)) as srv:
        yield srv


def _use(srv: FaultServer, form: str, base: bool = False) -> tuple[str, str]:
    """(the form's URL, its secret), the server set to require its header; ``base``: a base URL (a config's
    `endpoint`, which takes no `/v1`)."""
    url, header, secret = _forms(srv.port)[FORMS.index(form)]
    srv.config.require_authorization = header
    return (url.replace("/v1?", "/?") if base else url), secret


@pytest.mark.parametrize("form", FORMS)
def test_replay_sends_url_credentials_as_a_header_and_writes_them_nowhere(tmp_path, authed_server, form):
    url, secret = _use(authed_server, form)
    trace = synthetic_trace(2, steps=2, vocab_size=2000).write(tmp_path / "trace")
    out = tmp_path / "run"
    proc = _kvscope("replay", str(trace), "--endpoint", url, "--out", str(out), "--time-scale", "0",
                    "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert authed_server.stats.completions == 4 and authed_server.stats.unauthorized == 0
    assert json.loads((out / "summary.json").read_text())["requests"]["ok"] == 4
    _assert_nowhere(secret, proc, out)


@pytest.mark.parametrize("form", ["userinfo"])  # each waits out the 30 s health wait
def test_replay_against_a_dead_endpoint_prints_no_credentials(tmp_path, form):
    with FaultServer(FaultConfig()) as srv:
        url, _, secret = _forms(srv.port)[FORMS.index(form)]
    trace = synthetic_trace(1, steps=1, vocab_size=2000).write(tmp_path / "trace")
    out = tmp_path / "run"
    proc = _kvscope("replay", str(trace), "--endpoint", url, "--out", str(out), "--time-scale", "0",
                    "--no-progress", timeout=120)
    assert proc.returncode != 0 and proc.stderr.strip()
    _assert_nowhere(secret, proc, tmp_path / "run") if out.exists() else _assert_nowhere(secret, proc)


@pytest.mark.parametrize("form", FORMS)
def test_server_info_sends_url_credentials_and_prints_none(tmp_path, authed_server, form):
    url, secret = _use(authed_server, form)
    proc = _kvscope("server-info", "--endpoint", url, "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    facts = json.loads(proc.stdout)
    assert facts["endpoint"] == f"http://127.0.0.1:{authed_server.port}" and facts["block_size"]
    assert authed_server.stats.unauthorized == 0
    _assert_nowhere(secret, proc)
    if form == "userinfo":  # the table prints the same facts
        plain = _kvscope("server-info", "--endpoint", url, timeout=60)
        assert plain.returncode == 0 and "block_size" in plain.stdout
        _assert_nowhere(secret, plain)


@pytest.mark.parametrize("form", FORMS)
def test_server_info_error_prints_no_credentials(form):
    with FaultServer(FaultConfig()) as srv:
        url, _, secret = _forms(srv.port)[FORMS.index(form)]
    proc = _kvscope("server-info", "--endpoint", url, timeout=120)
    assert proc.returncode == 2 and "127.0.0.1" in proc.stderr
    _assert_nowhere(secret, proc)


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_capacity_calibrates_through_url_credentials_and_writes_them_nowhere(tmp_path, authed_server, form):
    url, secret = _use(authed_server, form, base=True)
    authed_server.config.ttft_s, authed_server.config.itl_s = 0.005, 0.002  # a step that takes time
    config = tmp_path / "server.yaml"
    config.write_text(f'backend: openai\nendpoint: "{url}"\nblock_size: 16\n')
    trace = synthetic_trace(2, steps=2, vocab_size=2000).write(tmp_path / "trace")
    out = tmp_path / "out"
    out.mkdir()
    proc = _kvscope("capacity", str(trace), "--server", str(config), "--save-calibration",
                    str(out / "calibration.json"), "--json", str(out / "capacity.json"), "--levels", "1,2",
                    "--min-fit-r2", "-100", "--runs", "1", timeout=400)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert authed_server.stats.unauthorized == 0 and authed_server.stats.completions > 10
    cal = json.loads((out / "calibration.json").read_text())
    assert cal["server"]["endpoint"] == f"http://127.0.0.1:{authed_server.port}"
    _assert_nowhere(secret, proc, out)


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_experiment_attaches_through_url_credentials_and_writes_them_nowhere(tmp_path, tiny_model_dir,
                                                                             authed_server, form):
    url, secret = _use(authed_server, form, base=True)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"""\
name: secrets
model: {{source: path, path: {tiny_model_dir}, served_model_name: tiny}}
servers:
  attached: {{backend: openai, endpoint: "{url}", block_size: 16}}
workloads:
  agent: {{spec: agent-coding, scale: 0.01, sessions: 1, seed: 0, max_context: 400}}
loads: [{{concurrency: 1}}]
repeats: 1
replay: {{time_scale: 0}}
""")
    out = tmp_path / "results"
    proc = _kvscope("experiment", "run", str(spec), "--out", str(out), "--run-id", "x", "--no-report", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert authed_server.stats.unauthorized == 0 and authed_server.stats.completions > 0
    _assert_nowhere(secret, proc, out, spec.parent / "results")


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_record_sends_url_credentials_upstream_and_writes_them_nowhere(tmp_path, authed_server, form):
    import httpx

    url, secret = _use(authed_server, form, base=True)
    out = tmp_path / "rec"
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.harness.cli.main", "record", "--upstream", url,
                             "--listen", "127.0.0.1:0", "--out", str(out), "--drain-s", "0.5"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline()
        proxy = banner.split()[2]
        r = httpx.post(proxy + "/v1/chat/completions", timeout=30, json={
            "model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(2)
        stdout, stderr = proc.communicate(timeout=60)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, banner + stdout, stderr)
    assert authed_server.stats.unauthorized == 0
    _assert_nowhere(secret, done, out)


@pytest.mark.parametrize("url,clean,header", [
    ("http://bob:pw@h:1/base?x=1", "http://h:1/base?x=1", "Basic " + base64.b64encode(b"bob:pw").decode()),
    ("https://h/v1?api_key=sk1&x=2", "https://h/v1?x=2", "Bearer sk1"),
    ("https://h/?access_token=t&token=u", "https://h/", "Bearer t"),
    ("http://sk2@h:8000", "http://h:8000", "Bearer sk2"),
    ("http://:sk3@[::1]:8000", "http://[::1]:8000", "Bearer sk3"),
    ("http://h:8000/?max_tokens=3", "http://h:8000/?max_tokens=3", None),
])
def test_split_url_credentials(url, clean, header):
    got, headers = split_url_credentials(url)
    assert got == clean and headers.get("Authorization") == header


def test_redact_config_cleans_urls_anywhere():
    from kvscope.harness.common.secrets import redact_config

    red = redact_config({"servers": {"a": {"endpoint": "http://u:secretpw@h:1?api_key=secretk"},
                                     "b": {"extra_args": ["--upstream", "http://u:secretpw@h"]}}})
    assert "secret" not in json.dumps(red)
    assert red["servers"]["a"]["endpoint"] == "http://h:1"
