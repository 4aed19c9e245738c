"""VLLMServer: command line, availability check, start-up failure reporting, and the Prometheus parser on text
captured from a real server with an EAGLE-3 draft."""

from __future__ import annotations

import json
import math
import sys

import pytest
from support.vllm_helpers import require_vllm, shared_server, write_random_eagle3_draft

from eagle3_train.serving import vllm_server as vs
from eagle3_train.serving.metrics import counter_total, parse_prometheus, spec_decode_counters
from eagle3_train.serving.vllm_options import speculative_config
from eagle3_train.utils.io import Eagle3InputError


def test_speculative_config_and_command(tmp_path):
    draft = write_random_eagle3_draft(tmp_path / "draft", draft_vocab=256)
    spec = speculative_config(draft, k=2)
    assert spec == {"method": "eagle3", "model": str(draft.resolve()), "num_speculative_tokens": 2}
    with pytest.raises(Eagle3InputError, match="no config.json"):
        speculative_config(tmp_path, 3)
    with pytest.raises(Eagle3InputError, match=">= 1"):
        speculative_config(draft, 0)

    server = vs.VLLMServer("/models/x", port=1234, served_model_name="x", speculative=spec, enforce_eager=True,
                           python=sys.executable, device="cpu")
    cmd = server.command()
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == "/models/x" and cmd[cmd.index("--port") + 1] == "1234"
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--enforce-eager" in cmd
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == spec
    assert server.base_url == "http://127.0.0.1:1234/v1" and server.model_name == "x"
    assert vs.VLLMServer("/models/y", port=1).model_name == "/models/y"


def test_hidden_states_server_command(tmp_path, tiny_llama_dir):
    verifier = tiny_llama_dir()  # 4 layers: default aux ids (1, 2, 3), captured with the last layer (4)
    server = vs.hidden_states_server(verifier, storage_dir=tmp_path / "hs", port=1234, python=sys.executable)
    cmd = server.command()
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3, 4]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == (vs.HS_CONNECTOR_CLASS, vs.HS_CONNECTOR_MODULE)
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str((tmp_path / "hs").resolve())
    assert "--enforce-eager" in cmd and cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.3"
    # The server imports the connector by its top-level name from PLUGIN_DIR, without our package.
    assert server.extra_env["PYTHONPATH"].split(":")[0] == str(vs.PLUGIN_DIR)
    source = (vs.PLUGIN_DIR / f"{vs.HS_CONNECTOR_MODULE}.py").read_text()
    assert "eagle3_train" not in "".join(ln for ln in source.splitlines() if ln.startswith(("import", "from")))
    assert server.hidden_states_layer_ids == [1, 2, 3, 4]
    assert vs.hidden_states_layer_ids(verifier, "0,1,2") == [0, 1, 2, 4]
    with pytest.raises(Eagle3InputError, match="out of range"):
        vs.hidden_states_layer_ids(verifier, "1,2,9")


def test_vllm_available_explains_how_to_install(tmp_path, monkeypatch):
    ok, msg = vs.vllm_available(tmp_path / "nope" / "python")
    assert not ok and "setup_vllm.sh" in msg
    # Our own environment has no vllm: a real interpreter that cannot import it.
    monkeypatch.setenv("EAGLE3_VLLM_PYTHON", sys.executable)
    assert vs.vllm_python() == vs.Path(sys.executable)
    ok, msg = vs.vllm_available()
    assert not ok and "cannot import vllm" in msg and "setup_vllm.sh" in msg
    with pytest.raises(Eagle3InputError, match="cannot import vllm"):
        vs.VLLMServer("/models/x").start()


def test_free_port_is_bindable():
    import socket

    port = vs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_prometheus_parser_handles_labels_escapes_and_suffixes():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="a \\"q\\" b"} 10.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09',
        'vllm:spec_decode_num_draft_tokens{engine="0"} 45',
        "vllm:spec_decode_num_accepted_tokens_total 9 1712345678000",
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1",engine="0"} 3',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0",engine="0"} 6',
        'vllm:kv_cache_usage_perc{engine="0",} NaN',
        'http_request_duration_seconds_bucket{le="+Inf"} +Inf',
        "",
    ])
    samples = parse_prometheus(text)
    assert len(samples) == 9
    assert samples[0].labels["model_name"] == 'a "q" b'
    assert math.isnan(samples[7].value) and samples[8].value == math.inf
    c = spec_decode_counters(samples)
    assert c.present and c.num_drafts == 15 and c.num_draft_tokens == 45 and c.num_accepted_tokens == 9
    assert c.accepted_per_pos == {0: 6, 1: 3}
    s = c.summary()
    assert s["mean_acceptance_length"] == pytest.approx(1 + 9 / 15)
    assert s["per_position_acceptance"] == pytest.approx([6 / 15, 3 / 15])
    zero = spec_decode_counters(parse_prometheus("vllm:generation_tokens_total 3\n"))
    assert not zero.present and zero.summary()["mean_acceptance_length"] is None
    assert c.since(c).summary()["num_drafts"] == 0
    with pytest.raises(ValueError, match="line 1"):
        parse_prometheus("not a sample line at all {\n")


@pytest.mark.slow
@pytest.mark.vllm
def test_server_death_is_reported_with_log_tail(tmp_path):
    require_vllm()
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchArchitecture"], "model_type": "nope"}))
    server = vs.VLLMServer(bad, log_path=tmp_path / "vllm.log", startup_timeout=600)
    with pytest.raises(RuntimeError, match="exited with code") as e:
        server.start()
    assert "last lines" in str(e.value) and len(str(e.value).splitlines()) > 2
    assert not server.running()


@pytest.mark.slow
@pytest.mark.vllm
def test_prometheus_text_of_a_real_speculative_server(tmp_path_factory):
    """Parse /metrics of a server with a random EAGLE-3 draft after a few requests."""
    require_vllm()
    import urllib.request

    import openai

    server = shared_server("eagle3", tmp_path_factory.mktemp("vllm"))
    client = openai.OpenAI(base_url=server.base_url, api_key="EMPTY")
    for q in ("Name a colour.", "Count to five."):
        client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": q}],
                                       max_tokens=12, temperature=0)
    text = urllib.request.urlopen(server.root_url + "/metrics").read().decode()
    sample_lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    samples = parse_prometheus(text)
    assert len(samples) == len(sample_lines)
    c = spec_decode_counters(samples)
    assert c.present
    print("spec-decode metric names:", c.metric_names)
    assert {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_per_pos_total"} <= set(c.metric_names)
    k = server.speculative["num_speculative_tokens"]
    assert c.num_drafts > 0 and c.num_draft_tokens == k * c.num_drafts
    assert sorted(c.accepted_per_pos) == list(range(k))
    assert sum(c.accepted_per_pos.values()) == c.num_accepted_tokens
    assert c.generation_tokens == counter_total(samples, "vllm:generation_tokens_total") > 0


def test_a_block_size_refusal_names_the_side_that_is_mla(tmp_path):
    """vLLM without AMX refuses an MLA cache beside a CPU-attention one, whichever side is MLA: the message says
    which one the user should change."""
    plain, mla = tmp_path / "plain", tmp_path / "mla"
    for d, cfg in ((plain, {"model_type": "llama"}), (mla, {"model_type": "deepseek_v3", "kv_lora_rank": 512})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    log = tmp_path / "vllm.log"
    log.write_text("ValueError: No common block size for CPU_MLA (16) and CPU_ATTN (32)\n")
    said = {}
    for name, (verifier, draft) in {"llama-beside-mla": (mla, plain), "mla-beside-llama": (plain, mla),
                                    "mla-beside-mla": (mla, mla)}.items():
        server = vs.VLLMServer(verifier, speculative=speculative_config(draft), log_path=log)
        said[name] = server._known_refusal()
    assert "draft with ordinary attention beside an MLA verifier" in said["llama-beside-mla"]
    assert "MLA draft beside a verifier with ordinary attention" in said["mla-beside-llama"]
    assert said["mla-beside-mla"] is None
