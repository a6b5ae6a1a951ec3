"""A model path that is no folder is looked up on the Hub within a bound (issue 34, item 13):
a typo fails in seconds with a message that says both what is not here and what the Hub said,
offline mode is respected, and a cached copy serves when the Hub does not answer. Imitation
Hubs on 127.0.0.1: one that accepts connections and never answers, one that knows a single
model; nothing is downloaded.

Before: ``model.path: tiny-modle`` against a Hub that never answered printed nothing for minutes
(transformers' revision lookup has no timeout); offline, the error never said that no local
folder of that name exists."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_core.errors import RunError
from grpo_core.spec.models import ModelSection
from grpo_core.testing import save_tiny_model
from grpo_core.train.model import hub_source, load_tokenizer, model_source

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def silent_hub():
    """A socket that accepts connections and never answers: a Hub behind a broken proxy."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def hub():
    """A Hub that knows one model, ``org/tiny`` (at commit :data:`SHA`)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] == "/api/models/org/tiny":
                body, status = json.dumps({"id": "org/tiny", "sha": SHA}).encode(), 200
            else:
                body, status = b'{"error": "Repository not found"}', 404
            self.send_response(status)
            if status == 404:
                self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def hub_settings(monkeypatch, tmp_path):
    """``hub_settings(endpoint, offline=False, timeout=1)``: huggingface_hub's settings (read from
    the environment when it is imported) for this test, with an empty cache of its own."""
    from huggingface_hub import constants

    def use(endpoint: str = "http://127.0.0.1:9", offline: bool = False, timeout: int = 1):
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
        monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", timeout)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))

    return use


def _cache(tmp_path, repo_id: str):
    """``repo_id`` in the cache of ``hub_settings`` at commit :data:`SHA`, as a download leaves it."""
    root = tmp_path / "hub-cache" / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SHA)
    return save_tiny_model(root / "snapshots" / SHA)


def test_a_hub_that_never_answers_fails_in_seconds_saying_both(tmp_path, write_spec, child, silent_hub):
    """A real ``grpo-run``: the typo is no folder, and the Hub lookup times out."""
    spec = write_spec(tmp_path, model={"path": "tiny-modle"})
    started = time.monotonic()
    proc = child([spec], env={"HF_ENDPOINT": silent_hub, "HF_HUB_ETAG_TIMEOUT": "1", "HF_HUB_OFFLINE": "0",
                              "HF_HOME": str(tmp_path / "hf-home")})
    code, out = proc.wait(90), proc.output()
    assert code == 1, out
    assert (f"grpo-run: error: model.path: 'tiny-modle' is not a folder (no {tmp_path / 'tiny-modle'}), and "
            f"looking it up on the Hub ({silent_hub}) failed: ReadTimeout") in out, out
    assert "HF_HUB_ETAG_TIMEOUT = 1 s" in out and "HF_HUB_OFFLINE=1" in out
    assert time.monotonic() - started < 60  # startup included; the lookup itself is bounded by 1 s


def test_offline_the_error_says_there_is_no_such_folder(tmp_path, hub_settings):
    hub_settings(offline=True)
    with pytest.raises(RunError) as info:
        load_tokenizer(ModelSection(path="tiny-modle"), tmp_path)
    assert str(info.value) == (
        f"model.path: 'tiny-modle' is not a folder (no {tmp_path / 'tiny-modle'}), nor in the Hugging Face cache "
        f"({tmp_path / 'hub-cache'}); HF_HUB_OFFLINE is set, so the Hub was not asked. Check the name, or "
        "download the model where the Hub is reachable")


def test_offline_a_cached_model_loads_without_the_hub(tmp_path, hub_settings):
    snapshot = _cache(tmp_path, "org/tiny")
    hub_settings(offline=True)
    assert model_source(ModelSection(path="org/tiny"), tmp_path) == (str(snapshot), None)
    assert load_tokenizer(ModelSection(path="org/tiny"), tmp_path).pad_token is not None


def test_a_silent_hub_falls_back_to_the_cached_copy(tmp_path, hub_settings, silent_hub, caplog):
    snapshot = _cache(tmp_path, "org/tiny")
    hub_settings(silent_hub, timeout=1)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="grpo.model"):
        assert model_source(ModelSection(path="org/tiny"), tmp_path) == (str(snapshot), None)
    assert time.monotonic() - started < 15
    assert "the Hub lookup of 'org/tiny' failed (ReadTimeout" in caplog.text


def test_a_model_the_hub_knows_is_loaded_at_the_commit_it_resolved(tmp_path, hub_settings, hub):
    hub_settings(hub)
    assert hub_source("org/tiny", None, tmp_path / "org/tiny", "model.path") == ("org/tiny", SHA)


@pytest.mark.parametrize(("name", "says"), [("org/tinyy", "nor a model on the Hub"),
                                            ("a/b/c", "nor a valid Hub model name")])
def test_a_name_the_hub_does_not_know_says_both(tmp_path, hub_settings, hub, name, says):
    hub_settings(hub)
    with pytest.raises(RunError) as info:
        load_tokenizer(ModelSection(path=name), tmp_path)
    assert str(info.value).startswith(f"model.path: '{name}' is not a folder (no {tmp_path / name}), {says} "
                                      f"({hub}); check the name")


def test_a_path_that_looks_local_is_never_looked_up(tmp_path, hub_settings, silent_hub):
    hub_settings(silent_hub)
    with pytest.raises(RunError, match=r"^model.path: folder .*/missing does not exist$"):
        model_source(ModelSection(path="./missing"), tmp_path)
