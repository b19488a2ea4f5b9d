"""The OpenAI surface beyond plain chat, with the official ``openai`` client against ``duet serve`` (demo model,
1 prefill + 1 decode over gloo): logprobs (chat and completions, streamed and not) equal to the local engine's
``log_softmax`` of its logits (prompt logprobs with ``echo`` too), ``n`` choices from one prefill, per-choice seeds, penalties, stop lists, echo,
``stream_options.include_usage``, and a 400 naming the field for what is not served. No KV block held after any.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from cluster.demo import default_model_dir
from engine import LLM, SamplingParams
from tests.cluster.serve.conftest import requests_counted, wait_idle

PROMPT = [5, 17, 42, 9, 33, 2, 71, 8, 19]  # token ids: /v1/completions takes them as they are
LOGPROB_TOL = 1e-4  # served (prefill + decode workers) vs a local engine: the same ops in other processes


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def local():
    return LLM(default_model_dir(), dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=256)


def _reference(local, params: SamplingParams) -> tuple[list[int], list[torch.Tensor]]:
    out = local.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    return out.token_ids, [torch.log_softmax(x.float(), dim=-1) for x in out.logits]


def test_completion_logprobs_equal_the_engines_log_softmax(oai, local, serve_cluster):
    ids, want = _reference(local, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True))
    r = oai.completions.create(model="duet-demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                               extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and len(lp.top_logprobs) == 6
    for step, (got, top, ref) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, want, strict=True)):
        assert abs(got - float(ref[ids[step]])) <= LOGPROB_TOL
        assert len(top) == 3 and max(top.values()) == pytest.approx(got, abs=LOGPROB_TOL)  # greedy: the best one
    specials = {"<|im_end|>", "<|endoftext|>", "<|end|>"}  # in tokens (ignore_eos runs past them), not in the text
    assert lp.text_offset[0] == 0 and "".join(t for t in lp.tokens if t not in specials) == r.choices[0].text
    stream = list(oai.completions.create(model="duet-demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                         stream=True, extra_body={"ignore_eos": True}))
    streamed = [x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=LOGPROB_TOL)
    wait_idle(serve_cluster)


def test_sampled_logprobs_are_of_the_distribution_sampled_from(oai, local):
    """temperature 0.7, top_k 5: each logprob is log_softmax of logits / 0.7 over the 5 best (first token from the
    prefill worker, the rest from decode); seed makes the served run and the local one draw the same tokens."""
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=5, ignore_eos=True, seed=3, return_logits=True)
    out = local.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    r = oai.completions.create(model="duet-demo", prompt=PROMPT, max_tokens=5, temperature=0.7, seed=3, logprobs=1,
                               extra_body={"top_k": 5, "ignore_eos": True})
    got = r.choices[0].logprobs.token_logprobs
    for tok, logits, lp in zip(out.token_ids, out.logits, got, strict=True):
        kept = logits / 0.7
        kept[kept < torch.topk(kept, 5).values[-1]] = float("-inf")
        assert abs(lp - float(torch.log_softmax(kept, dim=-1)[tok])) <= LOGPROB_TOL


def test_chat_logprobs_streamed_and_not(oai, serve_cluster):
    messages = [{"role": "user", "content": "Describe the image."}]
    r = oai.chat.completions.create(model="duet-demo", messages=messages, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    specials = {"<|im_end|>", "<|endoftext|>", "<|end|>"}  # the stop token has a logprob, not text
    assert "".join(t.token for t in content if t.token not in specials) == r.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob
               for t in content)
    chunks = list(oai.chat.completions.create(model="duet-demo", messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True, stream=True))
    streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in content], abs=LOGPROB_TOL)
    wait_idle(serve_cluster)


def _prefilled_tokens(cluster) -> int:
    return cluster.prefix_summary(cluster.status())["prompt_tokens"]


def test_n_choices_come_from_one_prefill_with_per_choice_seeds(oai, serve_cluster):
    before = _prefilled_tokens(serve_cluster)
    kwargs = dict(model="duet-demo", prompt=PROMPT, max_tokens=8, temperature=1.0, n=4, seed=7,
                  extra_body={"ignore_eos": True})
    r = oai.completions.create(**kwargs)
    assert _prefilled_tokens(serve_cluster) - before == len(PROMPT)  # the prompt was prefilled once for 4 choices
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 32
    assert len({c.text for c in r.choices}) > 1
    again = oai.completions.create(**kwargs)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(r.choices, key=lambda c: c.index)]  # seeds per choice are deterministic
    chunks = list(oai.completions.create(**kwargs, stream=True))
    by_choice = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                 for i in range(4)}
    assert by_choice == {c.index: c.text for c in r.choices}
    wait_idle(serve_cluster)


def test_cancelling_an_n_request_frees_every_choice(server, serve_cluster):
    """The stream started (200, a token of every choice), the client left: the request is cancelled, not run to its
    900 tokens, and its workers hold nothing within a second."""
    body = {"model": "duet-demo", "prompt": PROMPT, "max_tokens": 900, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        before = requests_counted(http, "cancelled", api="http")
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            started: set[int] = set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started |= {c["index"] for c in json.loads(line[len("data: "):])["choices"] if c["text"]}
                if started == {0, 1, 2}:
                    break
            else:
                pytest.fail(f"the stream ended before every choice had a token: {started}")
        assert wait_idle(serve_cluster, timeout_s=5) < 1.0
        assert requests_counted(http, "cancelled", api="http") == before + 1


def test_penalties_stop_lists_and_usage(oai, local, serve_cluster):
    pen = dict(frequency_penalty=1.5, presence_penalty=0.5)
    want = local.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                      repetition_penalty=1.3, **pen))[0]
    r = oai.completions.create(model="duet-demo", prompt=PROMPT, max_tokens=12, temperature=0, **pen,
                               extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert r.choices[0].text == want.outputs[0].text
    plain = oai.completions.create(model="duet-demo", prompt=PROMPT, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert plain.choices[0].text != r.choices[0].text  # the penalties changed the output
    # stop strings cut the penalized reply: the penalties keep it off one repeated token (the demo's greedy reply to
    # these ids is its end-of-turn token over and over, which prints nothing)
    text = r.choices[0].text
    assert len(text) >= 5, text
    stop = [text[3:5], "never-there"]
    s = oai.completions.create(model="duet-demo", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, **pen,
                               extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert s.choices[0].text == text[: text.index(stop[0])] and s.choices[0].finish_reason == "stop"
    chunks = list(oai.completions.create(model="duet-demo", prompt="red", max_tokens=4, temperature=0, stream=True,
                                         echo=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith("red")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4
    ends = [c for c in chunks if c.choices and c.choices[0].finish_reason]  # the timeline rides on the last one
    timeline = (ends[-1].model_extra or {}).get("duet_timeline")
    assert timeline and sum(timeline["ttft_breakdown"].values()) == pytest.approx(timeline["ttft_s"], abs=1e-6)
    c = oai.chat.completions.create(model="duet-demo", messages=[{"role": "user", "content": "Describe the image."}],
                                    max_completion_tokens=3, temperature=0)
    assert c.usage.completion_tokens == 3 and c.choices[0].finish_reason == "length"
    wait_idle(serve_cluster)


NOT_SERVED = {
    "logit_bias": ({"logit_bias": {"5": 10}}, "logit_bias"),
    "best_of": ({"best_of": 2}, "best_of"),
    "unknown field": ({"temprature": 0.5}, "temprature"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, "top_logprobs"),
    "too many top_logprobs": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "n out of range": ({"n": 0}, "'n'"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "bad penalty": ({"presence_penalty": 5}, "presence_penalty"),
    "unknown response_format": ({"response_format": {"type": "yaml"}}, "response_format"),
}
# (echo with logprobs is served: test_echo_with_logprobs_returns_the_prompts_logprobs)


@pytest.mark.parametrize("case", list(NOT_SERVED), ids=list(NOT_SERVED))
def test_what_is_not_served_is_a_400_naming_the_field(server, case):
    extra, field = NOT_SERVED[case]
    body = {"model": "duet-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_echo_with_logprobs_returns_the_prompts_logprobs(oai, local, serve_cluster):
    want = local.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                                      prompt_logprobs=1))[0].prompt_logprobs
    for stream in (False, True):
        kwargs = dict(model="duet-demo", prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1,
                      extra_body={"ignore_eos": True})
        if stream:
            chunks = list(oai.completions.create(**kwargs, stream=True))
            lps = [x for c in chunks if c.choices and c.choices[0].logprobs
                   for x in c.choices[0].logprobs.token_logprobs]
        else:
            lps = oai.completions.create(**kwargs).choices[0].logprobs.token_logprobs
        assert len(lps) == len(PROMPT) + 2 and lps[0] is None
        assert lps[1:len(PROMPT)] == pytest.approx([w.logprob for w in want[1:]], abs=LOGPROB_TOL)
    wait_idle(serve_cluster)


def test_grpc_sdk_carries_logprobs_and_choices(server, oai, serve_cluster):
    from duet_client import Client

    with Client(server.grpc_target) as client:
        c = client.generate_text(PROMPT, max_tokens=5, temperature=0, logprobs=2, ignore_eos=True, prompt_logprobs=0)
        many = client.generate_text(PROMPT, max_tokens=4, temperature=1.0, seed=7, n=3, ignore_eos=True)
    r = oai.completions.create(model="duet-demo", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                               extra_body={"ignore_eos": True})
    assert [lp.token_id for lp in c.logprobs] == c.token_ids
    assert [lp.token_id for lp in c.prompt_logprobs] == PROMPT[1:]
    assert [lp.logprob for lp in c.logprobs] == pytest.approx(r.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert all(len(lp.top) == 2 and lp.top[0][1] == pytest.approx(lp.logprob) for lp in c.logprobs)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert all(len(ch.token_ids) == 4 and ch.finish_reason == "length" for ch in many.choices)
    assert many.usage.completion_tokens == 12 and many.text == many.choices[0].text
    wait_idle(serve_cluster)


def test_a_version_1_grpc_request_is_served_as_before(server):
    import grpc

    from duet_client._proto.duet.v1 import duet_pb2 as pb
    from duet_client._proto.duet.v1 import duet_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.grpc_target) as ch:
        req = pb.GenerateRequest(api_version=1, prompt_token_ids=pb.TokenIds(ids=PROMPT),
                                 sampling=pb.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        resps = list(pb_grpc.DuetStub(ch).Generate(req, timeout=60))
    deltas = [r.delta for r in resps if r.WhichOneof("kind") == "delta"]
    assert sum(len(d.token_ids) for d in deltas) == 3
    assert all(d.index == 0 and not d.logprobs for d in deltas)  # nothing a version-1 client did not ask for
    assert resps[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
