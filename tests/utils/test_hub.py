"""utils/hub.py: a model name that is not here and cannot be fetched fails at once with the fix (no hub client
retries): a missing local path, offline and not cached, the Hub unreachable or without the model."""

import http.server
import threading
import time

import pytest

from rltrain.utils import hub
from rltrain.utils.hub import HubModelError, check_model_source


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    hub._probe.cache_clear()
    yield
    hub._probe.cache_clear()


@pytest.fixture
def fake_hub(monkeypatch):
    """A local HTTP server as HF_ENDPOINT: /api/models/org/there answers 200, anything else 404."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/api/models/org/there" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield
    server.shutdown()


def test_a_local_path_that_does_not_exist_names_the_key(tmp_path):
    with pytest.raises(HubModelError, match=r"model.path='/nowhere/qwen' does not exist; fix model.path \(a local"):
        check_model_source("/nowhere/qwen")
    check_model_source(str(tmp_path))  # an existing directory: nothing to ask


def test_offline_and_not_cached_fails_without_asking_the_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://192.0.2.1:9")  # TEST-NET: any request would hang until its timeout
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(HubModelError) as err:
        check_model_source("Qwen/Qwen3-0.6B")
    assert time.monotonic() - start < 2
    msg = str(err.value)
    assert "model.path='Qwen/Qwen3-0.6B' is not a local directory and not in the Hugging Face cache" in msg
    assert "HF_HUB_OFFLINE=1" in msg and "huggingface-cli download Qwen/Qwen3-0.6B --local-dir" in msg
    # in the cache (the hub client's layout): offline is fine
    snap = tmp_path / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "models--Qwen--Qwen3-0.6B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen3-0.6B" / "refs" / "main").write_text("abc")
    check_model_source("Qwen/Qwen3-0.6B")


def test_an_unreachable_hub_fails_at_once_with_the_fix(monkeypatch, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(HubModelError, match="cannot be reached.*point model.path at a local directory"):
        check_model_source("Qwen/Qwen3-0.6B")
    assert time.monotonic() - start < hub.PROBE_TIMEOUT_S


def test_the_hub_without_the_model_says_so_and_with_it_passes(fake_hub):
    check_model_source("org/there")
    with pytest.raises(HubModelError, match=r"model.tokenizer='org/typo' is not a local directory and not found on "
                                            r"the Hub .*HTTP 404.*huggingface-cli login"):
        check_model_source("org/typo", "model.tokenizer")
