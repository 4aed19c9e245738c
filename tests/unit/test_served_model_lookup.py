"""`evaluate served` without --model asks the server which model it serves, through the same client lookup generate
uses: the one model's name, or one clear error (unreachable server), never a urllib traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle3_train.evaluate.served import _served_model
from eagle3_train.serving.vllm_server import free_port
from eagle3_train.utils.io import Eagle3InputError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from reliability_campaign import FakeServer  # noqa: E402


def test_the_one_served_model_is_named():
    server = FakeServer(service_s=0.0, model="the-draft-verifier")
    try:
        assert _served_model(server.url) == "the-draft-verifier"
    finally:
        server.close()


def test_an_unreachable_server_is_one_clear_error():
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(Eagle3InputError, match=f"cannot list the models of {url}"):
        _served_model(url)
