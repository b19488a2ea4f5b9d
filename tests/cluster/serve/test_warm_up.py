"""The front-end's start-up warm-up (cluster.serve.service.InferenceService): a first request's one-time costs (the
chat template compiled, the tokenizer's first call) are paid on a preprocessing thread when the service starts."""

from __future__ import annotations

import time
from types import SimpleNamespace

from cluster.demo import default_model_dir
from cluster.serve.limits import Limits
from cluster.serve.service import InferenceService
from engine.config import ModelConfig
from engine.tokenizer import Tokenizer


class _Cluster:
    """What the service reads of a cluster at start, and a ``prepare`` that records its prompts."""

    def __init__(self, fail: bool = False) -> None:
        d = default_model_dir()
        self.spec = SimpleNamespace(model_dir=str(d))
        self.inputs = SimpleNamespace(cfg=ModelConfig.from_pretrained(d), max_model_len=1024)
        self.tokenizer = Tokenizer.from_pretrained(d)
        self.fail, self.prepared = fail, []

    def prepare(self, prompt):
        self.prepared.append(prompt)
        if self.fail:
            raise RuntimeError("the cluster is not up")
        return (SimpleNamespace(token_ids=self.tokenizer.encode(prompt["prompt"])), {})


def _started(cluster: _Cluster) -> None:
    service = InferenceService(cluster, Limits(), "demo")
    try:
        deadline = time.monotonic() + 10
        while not cluster.prepared and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        service.close()


def test_the_service_prepares_one_chat_prompt_at_start():
    cluster = _Cluster()
    _started(cluster)
    (prompt,), = [cluster.prepared]
    assert "Hello" in prompt["prompt"] and prompt["prompt"] != "Hello"  # rendered through the chat template


def test_a_failing_warm_up_does_not_stop_the_service():
    cluster = _Cluster(fail=True)
    _started(cluster)  # the error stays in the warm-up; close() still works
    assert len(cluster.prepared) == 1
