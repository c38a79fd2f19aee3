"""Every result file kvscope writes validates when read back; another version, another format or corrupt JSON
is a one-line error naming the file, the version found and the versions supported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.harness.common.errors import ConfigError, KvscopeError
from kvscope.harness.results.loaders import (load_experiment_file, load_report_file, load_results,
                                            load_run_manifest, load_summary, write_result_file)
from kvscope.harness.results.schemas import (DEFAULT_PRICING, ExperimentFile, ExperimentSpecCore, ManifestFile,
                                            NotebookEntry, ReportFile, SummaryFile)
from kvscope.workloads.errors import TraceFileError
from kvscope.workloads.trace import Trace
from kvscope.workloads.trace_schema import read_trace_file

SPEC = {"name": "schemas", "servers": {"a": {"max_model_len": 1024}}, "workloads": {"w": {"spec": "chat"}},
        "slo": {"ttft_ms": 250}}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real small replay against the fault server: the runner writes summary.json and manifest.json."""
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.replay.runner import replay
    from kvscope.workloads.generate import synthetic_trace
    from tests.doubles.faultserver import FaultConfig, FaultServer

    root = tmp_path_factory.mktemp("schemas")
    trace_dir = synthetic_trace(3, steps=2, prompt_tokens=64, output_tokens=8).write(root / "trace")
    with FaultServer(FaultConfig(model="tiny")) as server:
        replay(trace_dir, root / "run", ReplayOptions(concurrency=2, progress=False, time_scale=0, slo_ttft_ms=500),
               endpoints=[server.endpoint])
    return root / "run"


def _experiment_manifest(spec) -> dict:
    return {"experiment": spec.name, "run_id": "r1", "spec": spec.model_dump(mode="json"), "spec_path": "s.yaml",
            "created_at": 1.0, "kvscope_version": "0.1.0",
            "model": {"path": "/m", "tokenizer": "/m", "card": {"weights": "random"}, "weights_random": True},
            "cells": {"a__w__c1__r0": {"server": "a", "workload": "w", "load": "c1", "repeat": 0, "status": "ok",
                                       "dir": "cells/a__w__c1__r0"}},
            "servers": {"a": {"config": {"model": "/m"}, "restarts": 0, "log": "servers/a.log",
                              "facts": {"block_size": 16}}},
            "traces": {"w": "traces/w"}}


def _spec():
    from kvscope.harness.experiment.spec import ExperimentSpec

    return ExperimentSpec.model_validate(SPEC)


# ------------------------------------------------------------------------------------------ round trips


def test_replay_writes_summary_and_manifest_that_validate(run_dir):
    summary = load_summary(run_dir)
    assert (summary.format, summary.version) == ("kvscope-summary", 2)
    assert summary.requests.sent == 6 and summary.requests.failed == 0
    assert summary.goodput is not None and summary.goodput.slo_ttft_ms == 500
    assert summary.server_facts and summary.client.cpu_s >= 0
    manifest = load_run_manifest(run_dir / "manifest.json")
    assert manifest.format == "kvscope-run-manifest"
    assert manifest.options["slo_ttft_ms"] == 500
    assert manifest.trace.path.endswith("trace")
    # the file on disk is exactly the model's dump: nothing the model does not know was written
    raw = json.loads((run_dir / "summary.json").read_text())
    assert SummaryFile.model_validate(raw).model_dump(mode="json") == raw


def test_overlapping_run_without_calibration_says_its_predictor_is_the_sequential_simulator(run_dir):
    """Concurrency 2 and no calibration: the sequential simulator predicts, and the summary says why."""
    from kvscope.harness.results.records import read_records

    hit = load_summary(run_dir).hit_rate
    assert hit.predictor == "sequential" and "no calibration" in hit.predictor_note
    assert hit.sequential_requests_predicted_exactly == hit.requests_predicted_exactly
    assert hit.predicted_exact_share == hit.requests_predicted_exactly / hit.requests_compared
    df = read_records(run_dir)
    assert (df["predictor"] == "sequential").all()
    assert (df["predicted_cached_tokens_sequential"] == df["predicted_cached_tokens"]).all()


def test_version_1_files_read_as_sequential_predictions(run_dir, tmp_path):
    """A summary.json of version 1 and a requests.parquet without the predictor columns (runs recorded before
    they existed) read as the sequential simulator's predictions, which is what those runs recorded."""
    import shutil

    import pandas as pd

    from kvscope.harness.results.records import read_records

    old = tmp_path / "old"
    shutil.copytree(run_dir, old)
    raw = json.loads((old / "summary.json").read_text())
    raw["version"] = 1
    for key in ("predictor", "predictor_note", "calibration", "predicted_exact_share", "sequential_predicted",
                "sequential_requests_predicted_exactly", "sequential_exact_share"):
        raw["hit_rate"].pop(key)
    (old / "summary.json").write_text(json.dumps(raw))
    df = pd.read_parquet(old / "requests.parquet").drop(columns=["predictor", "predicted_cached_tokens_sequential"])
    df.to_parquet(old / "requests.parquet")
    hit = load_summary(old).hit_rate
    assert hit.predictor == "sequential"
    assert hit.sequential_requests_predicted_exactly == hit.requests_predicted_exactly
    assert hit.sequential_predicted == hit.predicted
    records = read_records(old)
    assert (records["predictor"] == "sequential").all()
    assert (records["predicted_cached_tokens_sequential"] == records["predicted_cached_tokens"]).all()
    (old / "requests.parquet").unlink()  # the raw log of version 1 (no predictor keys) reads the same
    lines = [json.loads(x) for x in (old / "requests.jsonl").read_text().splitlines()]
    (old / "requests.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k not in (
        "predictor", "predicted_cached_tokens_sequential")}) + "\n" for r in lines))
    assert (read_records(old)["predictor"] == "sequential").all()


def test_would_hit_is_written_only_when_prefix_caching_is_off(run_dir):
    """`would_hit` exists only when prefix caching is off (the console summary tests for the key)."""
    raw = json.loads((run_dir / "summary.json").read_text())
    caching_off = raw["server_facts"][0].get("prefix_caching") is False
    assert ("would_hit" in raw["hit_rate"]) == caching_off
    for present in (False, True):
        hit = {k: v for k, v in raw["hit_rate"].items() if not k.startswith("would_hit")}
        if present:
            hit["would_hit"] = None
        dumped = SummaryFile.model_validate({**raw, "hit_rate": hit}).model_dump(mode="json")["hit_rate"]
        assert ("would_hit" in dumped) == present


def test_load_results_reads_the_run_through_the_loaders(run_dir):
    res = load_results(run_dir)
    assert isinstance(res.summaries[run_dir.name], SummaryFile)
    assert res.run_manifest is not None and res.spec is None
    assert res.cells["requests"].iloc[0] == 6


def test_trace_json_round_trips(tmp_path):
    from kvscope.workloads.generate import synthetic_trace

    trace = synthetic_trace(2, steps=2)
    d = trace.write(tmp_path / "t")
    meta = read_trace_file(d / "trace.json")
    assert (meta.format, meta.version, meta.num_requests) == ("kvscope-trace", 1, 4)
    again = Trace.read(d)
    assert again.meta == meta.model_dump(mode="json")
    # written with sorted keys, so the same trace gives the same bytes
    d2 = again.write(tmp_path / "t2")
    assert (d / "trace.json").read_bytes() == (d2 / "trace.json").read_bytes()


def test_trace_metadata_with_an_unknown_field_is_refused_at_write(tmp_path):
    from kvscope.workloads.generate import synthetic_trace

    trace = synthetic_trace(1, steps=1)
    trace.meta["tokeniser"] = {}
    with pytest.raises(TraceFileError, match=r"trace\.json: trace metadata: tokeniser: Extra inputs"):
        trace.write(tmp_path / "t")


def test_experiment_json_records_the_validated_spec_with_defaults(tmp_path):
    from kvscope.harness.experiment.runner import _write_json
    from kvscope.harness.experiment.spec import ExperimentSpec

    path = tmp_path / "experiment.json"
    _write_json(path, ExperimentFile[ExperimentSpec].model_validate(_experiment_manifest(_spec())))
    raw = json.loads(path.read_text())
    # defaults the YAML never named are recorded
    assert raw["spec"]["replay"]["total_timeout_s"] == 1800.0 and raw["spec"]["repeats"] == 3
    assert raw["spec"]["cost"]["pricing"] == DEFAULT_PRICING
    assert raw["spec"]["loads"] == [{"name": "c1", "concurrency": 1, "session_rate": None}]
    full = load_experiment_file(path, ExperimentSpec)
    assert full.spec == _spec()
    core = load_experiment_file(tmp_path)  # what reports read: the core, typed, the rest kept
    assert isinstance(core.spec, ExperimentSpecCore) and core.spec.slo.ttft_ms == 250
    assert core.cells["a__w__c1__r0"].status == "ok"


def test_report_reads_slo_and_cost_from_the_typed_spec(tmp_path):
    from kvscope.harness.report.render import _parameters

    path = tmp_path / "experiment.json"
    write_result_file(path, ExperimentFile, _experiment_manifest(_spec()))
    res = load_results(tmp_path)
    params = _parameters(res.spec, {})
    assert params["latency"] == {"slo_ttft_ms": 250.0}
    assert params["cost"] == {"pricing": DEFAULT_PRICING, "hourly_usd": 2.0, "hardware": "the serving machine"}


def test_report_json_round_trips_and_earlier_entries_are_kept(tmp_path):
    from kvscope.harness.report.render import NotebookResult, _keep_earlier_results

    (tmp_path / "cost.html").write_text("<html></html>")
    report = ReportFile(notebooks=[NotebookEntry(notebook="cost", ok=True, error=None, seconds=1.5,
                                                 html="cost.html", figures=["figures/cost/a.png"])])
    write_result_file(tmp_path / "report.json", ReportFile, report)
    assert load_report_file(tmp_path) == report
    new = NotebookResult("hit_rates", True, tmp_path / "hit_rates.html", None, 2.0)
    merged = _keep_earlier_results(tmp_path, [new])
    assert [r.name for r in merged] == ["hit_rates", "cost"]
    assert merged[1].figures == [tmp_path / "figures/cost/a.png"]


def test_cost_presets_must_exist():
    from kvscope.harness.experiment.spec import ExperimentSpec
    from kvscope.harness.pricing.provider_cache import list_presets

    assert set(DEFAULT_PRICING) <= set(list_presets())  # the old default named presets that did not exist
    with pytest.raises(ValueError, match="unknown pricing preset.*anthropic-5m"):
        ExperimentSpec.model_validate({**SPEC, "cost": {"pricing": ["anthropic-5m"]}})


def test_experiment_spec_file_with_bad_cost_names_the_field(tmp_path):
    from kvscope.harness.experiment.spec import load_experiment_spec

    p = tmp_path / "s.yaml"
    p.write_text("name: x\nservers: {a: {}}\nworkloads: {w: {spec: chat}}\ncost: {pricing: [openai]}\n")
    with pytest.raises(ConfigError, match=r"s\.yaml.*cost\.pricing.*unknown pricing preset"):
        load_experiment_spec(p)


# ------------------------------------------------------------------------------- wrong version / format


def _valid_files(run_dir: Path, tmp_path: Path) -> dict[str, tuple[Path, object]]:
    """file kind -> (a valid file of that kind, its loader)."""
    from kvscope.workloads.generate import synthetic_trace

    exp = tmp_path / "exp"
    exp.mkdir()
    write_result_file(exp / "experiment.json", ExperimentFile, _experiment_manifest(_spec()))
    rep = tmp_path / "rep"
    rep.mkdir()
    write_result_file(rep / "report.json", ReportFile, ReportFile(notebooks=[]))
    trace_dir = synthetic_trace(1, steps=1).write(tmp_path / "trace")
    return {"summary": (run_dir / "summary.json", load_summary),
            "manifest": (run_dir / "manifest.json", load_run_manifest),
            "experiment": (exp / "experiment.json", load_experiment_file),
            "report": (rep / "report.json", load_report_file),
            "trace": (trace_dir / "trace.json", read_trace_file)}


KINDS = ["summary", "manifest", "experiment", "report", "trace"]
FORMATS = {"summary": "kvscope-summary", "manifest": "kvscope-run-manifest", "experiment": "kvscope-experiment",
           "report": "kvscope-report", "trace": "kvscope-trace"}
#: The versions each loader reads, as its error message lists them (summary 2 added the predictor, experiment 2 the sweep's plan; version 1 still reads).
SUPPORTED = {"summary": "1, 2", "manifest": "1", "experiment": "1, 2", "report": "1", "trace": "1"}


def _copy_with(src: Path, dst_dir: Path, **changes) -> Path:
    data = json.loads(src.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / src.name
    dst.write_text(json.dumps(data))
    return dst


def _one_line_error(loader, path: Path) -> str:
    with pytest.raises((KvscopeError, TraceFileError)) as info:
        loader(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    return msg


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_version_names_file_found_and_supported(kind, run_dir, tmp_path):
    src, loader = _valid_files(run_dir, tmp_path)[kind]
    supported = SUPPORTED[kind]
    msg = _one_line_error(loader, _copy_with(src, tmp_path / "v9", version=9))
    assert f"found format '{FORMATS[kind]}' version 9" in msg
    assert f"reads format '{FORMATS[kind]}' version {supported}" in msg


@pytest.mark.parametrize("kind", KINDS)
def test_missing_version_is_refused_with_the_same_message(kind, run_dir, tmp_path):
    src, loader = _valid_files(run_dir, tmp_path)[kind]
    msg = _one_line_error(loader, _copy_with(src, tmp_path / "nov", version=None))
    assert "version none" in msg and f"version {SUPPORTED[kind]}" in msg


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_format_is_refused(kind, run_dir, tmp_path):
    src, loader = _valid_files(run_dir, tmp_path)[kind]
    other = "kvscope-report" if kind != "report" else "kvscope-summary"
    msg = _one_line_error(loader, _copy_with(src, tmp_path / "fmt", format=other))
    assert f"found format '{other}'" in msg and FORMATS[kind] in msg


@pytest.mark.parametrize("kind", KINDS)
def test_corrupt_json_is_refused(kind, run_dir, tmp_path):
    src, loader = _valid_files(run_dir, tmp_path)[kind]
    bad = tmp_path / "bad" / src.name
    bad.parent.mkdir()
    bad.write_text(src.read_text()[: len(src.read_text()) // 2])  # a torn write
    assert "not valid JSON" in _one_line_error(loader, bad)


def test_a_wrong_field_is_named(run_dir, tmp_path):
    data = json.loads((run_dir / "summary.json").read_text())
    data["requests"]["sent"] = "many"
    data["throughput"]["tokens_per_s"] = 1.0
    bad = tmp_path / "summary.json"
    bad.write_text(json.dumps(data))
    msg = _one_line_error(load_summary, bad)
    assert "requests.sent" in msg and "1 more problem" in msg


def test_previous_release_report_json_list_is_refused(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps([{"notebook": "cost", "ok": True}]))
    msg = _one_line_error(load_report_file, tmp_path / "report.json")
    assert "not a JSON object" in msg and "kvscope-report" in msg


def test_load_results_refuses_an_experiment_of_another_version(run_dir, tmp_path):
    src, _ = _valid_files(run_dir, tmp_path)["experiment"]
    bad_dir = src.parent
    _copy_with(src, bad_dir, version=3)
    with pytest.raises(KvscopeError, match=r"experiment\.json: found format 'kvscope-experiment' version 3"):
        load_results(bad_dir)


@settings(max_examples=25, deadline=None)
@given(version=st.one_of(st.integers().filter(lambda v: v != 1), st.text(max_size=4), st.floats(allow_nan=False),
                         st.booleans(), st.just([1])))
def test_any_other_version_value_is_refused(tmp_path_factory, version):
    path = tmp_path_factory.mktemp("v") / "report.json"
    path.write_text(json.dumps({"format": "kvscope-report", "version": version, "notebooks": []}))
    with pytest.raises(KvscopeError, match="this kvscope reads format 'kvscope-report' version 1"):
        load_report_file(path)


def test_writers_refuse_data_that_does_not_fit(tmp_path):
    with pytest.raises(KvscopeError, match=r"manifest\.json \(writing\): kvscope_version"):
        write_result_file(tmp_path / "manifest.json", ManifestFile, {"trace": {}})
    assert not (tmp_path / "manifest.json").exists()


def test_a_speculative_summary_validates(run_dir):
    """The speculative block (not produced by the fault server) from the real summariser fits the model."""
    from kvscope.harness.results.summary import summarize
    from kvscope.harness.results.records import read_records

    raw = json.loads((run_dir / "summary.json").read_text())
    deltas = {"spec_decode_num_drafts": 12.0, "spec_acceptance_rate": 0.4, "spec_mean_acceptance_length": 1.8,
              "spec_acceptance_by_position": [0.6, float("nan"), 0.1], "prefix_cache_hit_rate": 0.5}
    body = summarize(read_records(run_dir), deltas, 1.0, False, weights_random=True)
    extras = {k: raw[k] for k in ("aborted", "client", "server_facts")}
    s = SummaryFile.model_validate({**body, **extras})
    assert s.speculative is not None and s.speculative.acceptance_by_position == [0.6, None, 0.1]
    assert s.speculative.note and s.hit_rate.would_hit is not None
