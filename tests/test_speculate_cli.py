"""`kvscope speculate`: every method on a trace and on a run's generated tokens, the versioned file it writes,
and one-line errors (exit 2) for bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kvscope.harness.results.speculation_file import load_speculation_file
from kvscope.workloads.trace import TraceBuilder
from tests.cli import kvscope


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    b = TraceBuilder()
    motif = rng.integers(10, 60, 8)
    for s in range(3):
        ids: list[int] = []
        for step in range(3):
            ids.append(b.add_segment(np.concatenate([rng.integers(10, 60, 30), motif]).astype(np.int32), "user"))
            out = b.add_segment(np.concatenate([motif, rng.integers(10, 60, 10)]).astype(np.int32), "assistant")
            b.add_request(session_id=f"s{s}", step=step, parent_request_id=-1, arrival_s=float(3 * s + step),
                          prompt_segment_ids=list(ids), output_segment_id=out, output_tokens=18,
                          transition="first" if step == 0 else "append")
            ids.append(out)
    return b.build({"name": "motifs"}).write(tmp_path_factory.mktemp("spec") / "trace")


def test_every_method_is_predicted_and_written_as_a_versioned_file(trace_dir, tmp_path):
    out = tmp_path / "speculation.json"
    r = kvscope("speculate", str(trace_dir), "--k", "3,5", "--lookup", "2-4", "--json", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    f = load_speculation_file(out)
    labels = [m.label for m in f.methods]
    assert labels == ["ngram k=3 n=2-4", "ngram k=5 n=2-4", "suffix depth=24 k<=24", "oracle k=3", "oracle k=5"]
    by = {m.label: m for m in f.methods}
    # the answers start with a motif the prompts hold: n-gram and suffix drafts are accepted
    assert by["ngram k=3 n=2-4"].num_accepted_tokens > 0 and by["suffix depth=24 k<=24"].num_accepted_tokens > 0
    assert by["oracle k=3"].acceptance_rate == 1.0
    assert all(m.requests == 9 for m in f.methods)
    assert "ngram k=3 n=2-4" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--method", "eagle"], "--method: unknown eagle; allowed: ngram, suffix, oracle"),
    (["--lookup", "4-2"], "need 1 <= MIN <= MAX"),
    (["--k", "0"], "a comma list of positive integers"),
])
def test_bad_flags_are_one_line_errors(trace_dir, args, message):
    r = kvscope("speculate", str(trace_dir), *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_a_path_that_is_neither_trace_nor_run_is_named(tmp_path):
    r = kvscope("speculate", str(tmp_path))
    assert r.returncode == 2
    assert f"{tmp_path}: neither a trace directory" in r.stderr and "Traceback" not in r.stderr


def test_the_page_predicts_every_method_per_workload_and_maps_the_servers_ngram_settings(trace_dir):
    from types import SimpleNamespace

    import pandas as pd

    from kvscope.harness.analysis.speculative import experiment_predictions, speculative_configs_of_servers
    from kvscope.harness.cachemodel.speculative import NgramConfig

    servers = {"base": {"config": {"max_model_len": 4096}},
               "ng": {"config": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_max": 3}}}}
    assert speculative_configs_of_servers({k: v["config"].get("speculative_config") for k, v in servers.items()}) \
        == {"ng": NgramConfig(3, 3, 3)}  # one of min/max given: the other mirrors it, as vLLM does
    from kvscope.harness.results.schemas import ServerEntry

    entries = {k: ServerEntry(config=v["config"], log="") for k, v in servers.items()}
    res = SimpleNamespace(server=entries.get,
                          cells=pd.DataFrame({"cell": ["c0", "c1"], "server": ["base", "ng"], "workload": ["w", "w"],
                                              "speculative": [False, True]}),
                          cell_dirs={}, trace_dir=lambda w: trace_dir)
    pred, pos, same = experiment_predictions(res)
    assert set(pred["setting"]) == {"ngram k=3 n=3-3", "ngram k=4 n=2-4", "ngram k=4 n=1-3",
                                    "suffix depth=24 k<=24", "oracle k=4"}
    assert (pred["trace"] == "w").all() and len(pos) > 0
    assert same.empty  # no cell directory with generated tokens


# ---- issue 40: nothing to predict, size knobs bounded by the trace, a --json folder that is not there -------


def _short_outputs_trace(path: Path, output_len: int) -> Path:
    rng = np.random.default_rng(1)
    b = TraceBuilder()
    for s in range(2):
        p = b.add_segment(rng.integers(10, 60, 30).astype(np.int32), "user")
        out = b.add_segment(rng.integers(10, 60, output_len).astype(np.int32), "assistant")
        b.add_request(session_id=f"s{s}", step=0, parent_request_id=-1, arrival_s=float(s), prompt_segment_ids=[p],
                      output_segment_id=out, output_tokens=output_len, transition="first")
    return b.build({"name": "short"}).write(path)


@pytest.mark.parametrize("output_len", [0, 1])
def test_a_trace_without_decode_steps_has_nothing_to_predict(tmp_path, output_len):
    """Probe: outputs of one token or none printed a table of dashes (and a pandas RuntimeWarning), exit 0."""
    trace = _short_outputs_trace(tmp_path / "t", output_len)
    r = kvscope("speculate", str(trace), "--no-progress")
    assert r.returncode == 2, r.stdout
    assert r.stderr.count("\n") == 1 and "nothing to predict" in r.stderr and str(trace) in r.stderr
    assert "Warning" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("args,named", [
    (["--suffix-depth", "1000000000"], "--suffix-depth 1000000000: longer than the longest request"),
    (["--k", "100000"], "--k 100000: longer than the longest recorded output (18 tokens)"),
    (["--k", "4,19"], "--k 19: longer than the longest recorded output"),
    (["--suffix-k", "25", "--method", "suffix"], "--suffix-k 25: longer than the longest recorded output"),
    (["--lookup", "2-100000"], "--lookup 100000: longer than the longest request"),
])
def test_size_knobs_beyond_what_the_trace_can_mean_are_refused_before_any_work(trace_dir, args, named):
    """Probe: --suffix-depth 1e9 on a 67-request trace grew to 20.6 GB; --k 100000 took 3.8 GB and 106 s. The
    trace's answers are 18 tokens and its longest request 126 (prompt and answer): a knob above that (and
    above its default) is one line naming it, with nothing computed."""
    r = kvscope("speculate", str(trace_dir), *args, "--no-progress")
    assert r.returncode == 2 and named in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert r.stdout == ""


def test_knobs_at_their_bound_and_defaults_on_short_outputs_still_run(trace_dir, tmp_path):
    r = kvscope("speculate", str(trace_dir), "--k", "18", "--suffix-depth", "126", "--no-progress")
    assert r.returncode == 0, r.stderr
    short = _short_outputs_trace(tmp_path / "t", 3)  # shorter than the default k (4) and depth (24)
    r = kvscope("speculate", str(short), "--no-progress")
    assert r.returncode == 0, r.stderr


def test_json_into_a_missing_folder_names_the_folder(trace_dir, tmp_path):
    """Probe: the error named speculate's own temporary file (.speculation.json.PID.tmp), not the folder."""
    target = tmp_path / "missing" / "speculation.json"
    r = kvscope("speculate", str(trace_dir), "--json", str(target), "--no-progress")
    assert r.returncode == 2 and f"{tmp_path / 'missing'}" in r.stderr and ".tmp" not in r.stderr, r.stderr
    assert r.stdout == ""


def test_write_versioned_names_the_folder_not_its_temporary_file(tmp_path):
    from kvscope.harness.results.speculation_file import SpeculationFile, write_speculation_file

    with pytest.raises(FileNotFoundError) as err:
        write_speculation_file(tmp_path / "missing" / "s.json", SpeculationFile(trace="t", methods=[]))
    assert err.value.filename == str(tmp_path / "missing") and ".tmp" not in str(err.value)
