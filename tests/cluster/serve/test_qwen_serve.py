"""``duet serve`` on a tiny Qwen3-VL-MoE checkpoint (1 prefill + 1 decode over gloo, on the session's Ray cluster):
the official ``openai`` package (chat with an image, streaming) and the gRPC SDK give the local engine's greedy
tokens for the same conversation, whose ids equal transformers' chat template + Qwen3-VL placeholder expansion; the
model info names the family; bad input (over ``max_visual_tokens``, image-pad runs not matching the images, video)
is 400 / INVALID_ARGUMENT and reserves nothing.
"""

from __future__ import annotations

import base64
import io

import grpc
import httpx
import pytest

from cluster.serve import Limits, ServeConfig, ServerThread
from duet_client import Client, InvalidArgument
from duet_client._proto.duet.v1 import duet_pb2 as pb
from duet_client._proto.duet.v1 import duet_pb2_grpc as pb_grpc
from engine import LLM, SamplingParams
from duet_testing.qwen_checkpoints import QwenTinySpec, make_tiny_qwen_checkpoint
from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor
from tests.conftest import make_image

SPEC = QwenTinySpec()
MAX_VISUAL_TOKENS = 20  # the tiny processor caps an image at 128 x 128 pixels = 16 tokens; two such images are over
QUESTION = "Describe the image."
MAX_TOKENS = 8


def _png(seed: int, size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    make_image(seed, size).save(buf, format="PNG")
    return buf.getvalue()


SMALL = _png(0, (50, 70))  # 64 x 64 after resizing: grid (1, 4, 4), 4 visual tokens
LARGE = _png(1, (300, 400))  # 96 x 128: grid (1, 6, 8), 12 visual tokens


def _data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def expected_prompt_ids(model_dir, num_tokens: list[int]) -> list[int]:
    """transformers' ids for one user turn ``[image part, QUESTION]``: its tokenizer's ``apply_chat_template`` text,
    tokenized, each ``<|image_pad|>`` expanded to its image's count (what ``Qwen3VLProcessor`` does)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    content = [{"type": "image"}] * len(num_tokens) + [{"type": "text", "text": QUESTION}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    counts = iter(num_tokens)
    ids: list[int] = []
    for t in tok(text)["input_ids"]:
        ids.extend([t] * next(counts) if t == SPEC.image_token_id else [t])
    return ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen_checkpoint(tmp_path_factory.mktemp("qwen") / "ckpt", SPEC)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The local engine's greedy tokens and text for the one-image conversation, and its prompt ids."""
    import PIL.Image

    proc = QwenVLImageProcessor.from_pretrained(model_dir)
    image = PIL.Image.open(io.BytesIO(SMALL))
    ids = expected_prompt_ids(model_dir, [proc.num_visual_tokens(image.height, image.width)])
    llm = LLM(model_dir, dtype="float32", max_model_len=256, num_kv_blocks=64)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}],
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0]
    return {"prompt_ids": ids, "token_ids": list(out.token_ids), "text": out.text}


@pytest.fixture(scope="module")
def cluster(ray_cluster, model_dir):
    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec

    c = DisaggCluster(ClusterSpec(model_dir=str(model_dir), local_prefill_tokens=0,
                                  num_prefill=1, num_decode=1, transport="gloo",
                                  num_kv_blocks=128, cpus_per_worker=1, max_model_len=256, request_timeout_s=60))
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def server(cluster):
    t = ServerThread(cluster, ServeConfig(grpc_port=0, http_port=0, model_name="qwen-tiny", drain_timeout_s=5,
                                          limits=Limits(max_visual_tokens=MAX_VISUAL_TOKENS)))
    srv = t.start()
    yield srv
    t.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.grpc_target) as c:
        yield c


def _assert_nothing_held(server, cluster) -> None:
    held = cluster.check_no_leaks()
    assert held and all(v == 0 for v in held.values()), held
    assert server.service.admission.in_flight == 0


def _chat(images: list[bytes], question: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": _data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


# ----------------------------------------------------------------------------------------------- the same tokens
def test_chat_prompt_ids_equal_transformers_template_and_expansion(server, reference):
    """The service's rendering (image content parts through the checkpoint's template) tokenizes to transformers'
    ids, whether the message came as OpenAI parts (``<image>`` in the text) or a plain string with ``<image>``."""
    from cluster.serve.openai_requests import chat_input
    from cluster.serve.schema import GenerateInput, ImageInput

    service = server.service
    as_string = GenerateInput(prompt=f"<image>{QUESTION}", images=[ImageInput(SMALL, "image/png")])
    for inp in (chat_input({"messages": _chat([SMALL])}), as_string):
        assert service.cluster.prepare(service._build_prompt(inp))[0].token_ids == reference["prompt_ids"]


def test_openai_chat_with_an_image_equals_the_local_engine(server, cluster, reference):
    from openai import OpenAI

    oai = OpenAI(base_url=f"{server.http_url}/v1", api_key="unused")
    assert [m.id for m in oai.models.list().data] == ["qwen-tiny"]
    r = oai.chat.completions.create(model="qwen-tiny", messages=_chat([SMALL]), max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == reference["text"]
    assert r.usage.completion_tokens == len(reference["token_ids"])
    assert r.usage.prompt_tokens == len(reference["prompt_ids"])
    chunks = list(oai.chat.completions.create(model="qwen-tiny", messages=_chat([SMALL]), max_tokens=MAX_TOKENS,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["text"]
    assert chunks[-1].usage.completion_tokens == len(reference["token_ids"])
    _assert_nothing_held(server, cluster)


def test_grpc_sdk_with_an_image_equals_the_local_engine(server, cluster, client, reference):
    c = client.generate_text(f"<image>{QUESTION}", images=[SMALL], max_tokens=MAX_TOKENS, temperature=0)
    assert c.token_ids == reference["token_ids"] and c.text == reference["text"]
    chat = [{"role": "user", "content": f"<image>{QUESTION}"}]
    assert client.generate_text(messages=chat, images=[SMALL], max_tokens=MAX_TOKENS,
                                temperature=0).token_ids == reference["token_ids"]
    with client.generate(reference["prompt_ids"], images=[SMALL], max_tokens=MAX_TOKENS,
                         temperature=0) as stream:
        streamed = [t for d in stream for t in d.token_ids]
    assert streamed == reference["token_ids"]
    _assert_nothing_held(server, cluster)


def test_model_info_names_the_family_and_the_grid(client):
    (info,) = client.list_models()
    assert info["architecture"] == "qwen3_vl/qwen3_vl_moe_text" and info["vision"]
    assert (info["tokens_per_image"], info["patch_size"], info["merge_size"]) == (0, 16, 2)
    assert info["max_visual_tokens"] == MAX_VISUAL_TOKENS


# ------------------------------------------------------------------------------------------------------ bad input
def test_over_max_visual_tokens_is_400_and_invalid_argument(server, cluster, client):
    r = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=30,
                   json={"messages": _chat([LARGE, LARGE]), "max_tokens": 2})
    assert r.status_code == 400 and "max_visual_tokens is 20" in r.json()["error"]["message"]
    with pytest.raises(InvalidArgument, match=r"need 24 visual tokens \(\[12, 12\]\); max_visual_tokens is 20"):
        client.generate_text("<image><image>Compare.", images=[LARGE, LARGE], max_tokens=2)
    _assert_nothing_held(server, cluster)


def test_mismatched_image_pad_runs_are_invalid_argument(server, cluster, client, reference):
    ids = reference["prompt_ids"]
    pad = SPEC.image_token_id
    short = ids[:ids.index(pad)] + ids[ids.index(pad) + 1:]  # one pad too few for the image's grid
    with pytest.raises(InvalidArgument, match="placeholder runs hold"):
        client.generate_text(short, images=[SMALL], max_tokens=2)
    with pytest.raises(InvalidArgument, match="placeholder runs hold"):
        client.generate_text(ids, images=[LARGE], max_tokens=2)  # 4 pads, 12 needed
    r = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=30,  # one image part, two images' markers
                   json={"messages": [{"role": "user", "content": [
                       {"type": "image_url", "image_url": {"url": _data_url(SMALL)}},
                       {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>Compare."}]}]})
    assert r.status_code == 400 and "image placeholder" in r.json()["error"]["message"]
    _assert_nothing_held(server, cluster)


def test_video_is_400_and_invalid_argument(server, cluster, client, reference):
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    r = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": [video, {"type": "text", "text": "What?"}]}]})
    assert r.status_code == 400 and "video inputs are not supported" in r.json()["error"]["message"]
    ids = [SPEC.special_token_ids["<|video_pad|>"] if t == SPEC.image_token_id else t for t in reference["prompt_ids"]]
    with pytest.raises(InvalidArgument, match="video inputs are not supported"):
        client.generate_text(ids, max_tokens=2)
    with grpc.insecure_channel(server.grpc_target) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.DuetStub(ch).Generate(pb.GenerateRequest(api_version=1, prompt="<|video_pad|>What?",
                                                               raw_prompt=True), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "video" in e.value.details()
    _assert_nothing_held(server, cluster)
