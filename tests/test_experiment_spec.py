from pathlib import Path

import pytest

from kvscope.harness.common.errors import ConfigError
from kvscope.harness.experiment.runner import plan_cells
from kvscope.harness.experiment.spec import load_experiment_spec

REPO = Path(__file__).resolve().parents[1]


def test_shipped_specs_validate_and_plan_in_stated_order():
    spec, _ = load_experiment_spec(REPO / "experiments" / "quickstart.yaml")
    cells = [c.name for c in plan_cells(spec)]
    assert len(cells) == 3 * 3 * 1 * 3  # servers x grid workloads x loads x repeats; agent-sweep is sweep-only
    assert cells[:2] == ["baseline__agent-coding__c2__r0", "baseline__agent-coding-timestamped__c2__r0"]
    assert cells[9] == "baseline__agent-coding__c2__r1"  # repeat-major: the arms interleave
    assert {c.split("__")[0] for c in cells} == {"baseline", "no-prefix-cache", "ngram-k4"}
    assert spec.sweep is not None and len(spec.sweep.levels) >= 5
    assert spec.sweep.ttft_slo.unloaded_factor == 3  # relative: a capacity on slow and fast machines alike
    # the history carries what the server generated, as a real agent's does (recorded mode's planned answers
    # never match what the server cached: an artefact a reader would take for eviction)
    assert spec.replay.mode == "live"
    assert spec.predicted is not None and spec.predicted_workloads() == [
        "agent-coding", "agent-coding-timestamped", "agent-coding-compaction"]  # the grid's: sweep_only left out
    assert {(c.gpu, c.model, c.tp) for c in spec.predicted.configs.values()} == {
        ("h100-sxm", "llama-3.1-8b", 1), ("h200-sxm", "llama-3.1-70b", 4)}
    assert spec.predicted_slo_ttft_p90_ms() == 2000  # the sweep's SLO is relative to the CPU: the stated default
    # prediction traces of more sessions than the grid's 4, at a GPU-sized scale, so a GPU's loads are driven
    assert spec.predicted.sessions > spec.workloads["agent-coding"].sessions
    assert spec.predicted.scale is not None and spec.predicted.scale > spec.workloads["agent-coding"].scale
    gpu, _ = load_experiment_spec(REPO / "experiments" / "gpu-llama31-8b.yaml")
    assert gpu.model.source == "hf" and "eagle3" in gpu.servers


_PRED = "name: x\nservers: {a: {}}\nworkloads: {w: {spec: chat}}\npredicted:\n"


@pytest.mark.parametrize("body,needles", [
    ("name: x\nservers: {a: {}}\nworkloads: {w: {spec: chat}}\nrepeat: 2\n", ["repeat", "unknown field", "repeats"]),
    ("name: x\nservers: {a: {}}\nworkloads: {w: {spec: chat, scael: 2}}\n", ["workloads.w.scael", "unknown field"]),
    ("name: x\nservers: {a: {}}\nworkloads: {w: {spec: chat}}\nloads: [{concurrency: 1, session_rate: 2}]\n",
     ["loads[0]", "exactly one of concurrency or session_rate"]),
    ("name: x\nservers: {a: {max_num_seqs: lots}}\nworkloads: {w: {spec: chat}}\n", ["servers.a", "max_num_seqs"]),
    ("name: x\nservers: {a: {prefix_cache: false}}\nworkloads: {w: {spec: chat}}\n",
     ["servers.a", "prefix_cache", "enable_prefix_caching"]),
    ("name: x\nworkloads: {w: {spec: chat}}\n", ["servers", "required"]),
    (_PRED + "  configs: {g: {gpu: h100-sxmm, model: llama-3.1-8b}}\n",
     ["predicted.configs.g", "unknown GPU 'h100-sxmm'", "h200-sxm"]),
    (_PRED + "  configs: {g: {gpu: h100-sxm, model: llama-9}}\n",
     ["predicted.configs.g", "unknown model 'llama-9'", "llama-3.1-8b"]),
    (_PRED + "  configs: {g: {gpu: h100-sxm, model: llama-3.1-70b}}\n",
     ["predicted.configs.g", "does not fit on h100-sxm with tp 1"]),
    (_PRED + "  configs: {g: {gpu: h100-sxm, model: llama-3.1-8b, tp: 3}}\n",
     ["predicted.configs.g", "tensor parallel size 3 does not divide"]),
    (_PRED + "  configs: {g: {gpu: h100-sxm, model: llama-3.1-8b, kv_cache_dtype: fp7}}\n", ["fp7"]),
    (_PRED + "  configs: {g: {gpu: h100-sxm, model: llama-3.1-8b, gpus: 2}}\n", ["predicted.configs.g.gpus", "unknown field"]),
    (_PRED + "  configs: {g: {gpu: h100-sxm, model: llama-3.1-8b}}\n  workloads: [v]\n",
     ["predicted.workloads: unknown v", "known: w"]),
    (_PRED + "  configs: {g: {gpu: h100-sxm, model: llama-3.1-8b}}\n  sessions: 5000\n",
     ["predicted.sessions", "less than or equal to 1024"]),
    (_PRED + "  configs: {traces: {gpu: h100-sxm, model: llama-3.1-8b}}\n",
     ["predicted.configs", "'traces' is reserved"]),
])
def test_spec_errors_name_file_field_and_allowed(tmp_path, body, needles):
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    with pytest.raises(ConfigError) as e:
        load_experiment_spec(p)
    msg = str(e.value)
    assert str(p) in msg
    for n in needles:
        assert n in msg, (n, msg)


_MODELS = ("name: x\nworkloads: {w: {spec: chat}}\nmodel: {path: models/tiny, pricing: gemini-2.5-flash-implicit}\n"
           "models:\n  big: {path: models/tiny-large, size: large, served_model_name: big, gpu_hourly_usd: 4.0}\n")


@pytest.mark.parametrize("body,needles", [
    (_MODELS + "servers: {a: {}, b: {serves: huge}}\n", ["servers.b.serves: unknown model 'huge'", "models: big"]),
    ("name: x\nworkloads: {w: {spec: chat}}\nservers: {a: {serves: big}}\n",
     ["unknown model 'big'", "add a models: section"]),
    (_MODELS.replace("gpu_hourly_usd: 4.0", "gpu_hourly_usd: 4.0, pricing: anthropic-sonnet-5m")
     + "servers: {a: {}}\n", ["models.big", "not both"]),
    (_MODELS.replace("gemini-2.5-flash-implicit", "nope-preset") + "servers: {a: {}}\n",
     ["model.pricing", "unknown pricing preset(s) nope-preset"]),
    (_MODELS.replace("size: large", "size: huge") + "servers: {a: {}}\n", ["models.big.size", "'small' or 'large'"]),
    (_MODELS.replace("path: models/tiny-large", "source: hf, path: org/m") + "servers: {a: {}}\n",
     ["models.big", "only for source tiny"]),
    (_MODELS + "servers: {a: {}}\n" + "models2: {}\n", ["models2", "unknown field"]),
])
def test_several_models_with_their_own_prices_are_checked(tmp_path, body, needles):
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    with pytest.raises(ConfigError) as e:
        load_experiment_spec(p)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_a_configuration_serves_its_model(tmp_path):
    """Each configuration's server gets the path and served name of the model it serves: ``model:``'s unless
    ``serves:`` names one of ``models:`` (paths as the runner prepared them)."""
    from kvscope.harness.experiment.spec import server_backend

    p = tmp_path / "ok.yaml"
    p.write_text(_MODELS + "servers: {small: {}, large: {serves: big, kv_cache_memory_bytes: 48M}}\n")
    spec, _ = load_experiment_spec(p)
    small = server_backend(spec, "small", "/prepared/tiny", model_paths={"big": "/prepared/big"})
    large = server_backend(spec, "large", "/prepared/tiny", model_paths={"big": "/prepared/big"})
    assert (small.config.model, small.config.served_model_name) == ("/prepared/tiny", "tiny")
    assert (large.config.model, large.config.served_model_name) == ("/prepared/big", "big")
    assert spec.served_model("large").gpu_hourly_usd == 4.0 and spec.served_model("small").pricing
    assert [c.server for c in plan_cells(spec)] == ["small", "large"] * 3  # an A/B of two models, as any two configurations


def test_served_models_must_share_the_workloads_tokenizer(tmp_path):
    from kvscope.harness.common.errors import KvscopeError
    from kvscope.harness.experiment.runner import prepare_model, prepare_served_models

    for name, tok in (("a", "T1"), ("b", "T1"), ("c", "T2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "tokenizer.json").write_text(tok)
    p = tmp_path / "s.yaml"
    p.write_text(f"name: x\nworkloads: {{w: {{spec: chat}}}}\nmodel: {{source: path, path: {tmp_path / 'a'}}}\n"
                 f"models: {{b: {{source: path, path: {tmp_path / 'b'}}}, c: {{source: path, path: {tmp_path / 'c'}}}}}\n"
                 "servers: {x: {}, y: {serves: b}}\n")
    spec, _ = load_experiment_spec(p)
    _, tokenizer_dir, _ = prepare_model(spec, tmp_path)
    assert prepare_served_models(spec, tmp_path, tokenizer_dir) == {"b": str(tmp_path / "b")}
    p.write_text(p.read_text().replace("serves: b", "serves: c"))
    spec, _ = load_experiment_spec(p)
    with pytest.raises(KvscopeError, match=r"models.c: its tokenizer .* differs from model:'s"):
        prepare_served_models(spec, tmp_path, tokenizer_dir)
