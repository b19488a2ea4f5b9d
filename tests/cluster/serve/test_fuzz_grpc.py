"""Fuzzing of the ``duet.v1`` gRPC API with hypothesis-built messages, against one front-end on the demo model
(1 prefill + 1 decode over gloo).

The strategies below build every request message of the service: ``GenerateRequest`` with each kind of input
(text with any number of ``<image>`` marks, token ids in and out of the vocabulary, chat turns with unknown roles,
no input at all), out-of-range and non-finite sampling numbers, empty and huge strings, images that are valid (several
formats and modes, odd sizes), header-only bombs, truncated, random or empty bytes with right or wrong MIME types,
unknown ``api_version`` values, and bytes of unknown fields appended to the wire form (no request field is an enum;
unknown field numbers are what an old server meets). Some calls are cancelled after their first reply, some aborted
by id. ``Abort``, ``ListModels`` and ``ClusterStatus`` get their messages too, and random bytes go to every method.

Every call must end typed: OK (a Generate stream ends with exactly one ``final``, deltas before it) or a specific
status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, CANCELLED when this test cancelled) with a message, never INTERNAL or
UNKNOWN; afterwards no worker died and no KV block is held. Example count: :mod:`.fuzz_support`.
"""

from __future__ import annotations

import io
import threading
import uuid

import grpc
import PIL.Image
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.serve.grpc_api import API_VERSION
from duet_client._proto.duet.v1 import duet_pb2 as pb
from tests.cluster.serve.conftest import png_header_only, wait_idle
from tests.cluster.serve.fuzz_support import TOKEN, Tally, assert_cluster_clean, fuzz_settings, serving, \
    total_examples

INT32 = (-(2 ** 31), 2 ** 31 - 1)
INT64 = (-(2 ** 63), 2 ** 63 - 1)
TYPED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
MD = (("authorization", f"Bearer {TOKEN}"),)
TALLY = Tally()
DEMO_VOCAB, DEMO_IMAGE_TOKEN, DEMO_IMAGE_TOKENS = 380, 4, 36  # the demo model's


# ------------------------------------------------------------------------------------------------------ strategies
def ints(lo: int, hi: int, edges: tuple[int, ...] = ()) -> st.SearchStrategy[int]:
    """Any integer of the field's wire range, with its edges and the values validators look at drawn often."""
    common = [v for v in (0, 1, -1, 2, lo, hi, *edges) if lo <= v <= hi]
    return st.one_of(st.sampled_from(common), st.integers(lo, hi), st.integers(-3, 40).filter(lambda v: lo <= v <= hi))


def floats() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([0.0, 1.0, -0.0, 0.5, 2.0, -1.0, 1e-30]), st.floats(width=32))


def texts(max_size: int = 40) -> st.SearchStrategy[str]:
    """Short text, empty text, text with the image mark, or a huge string (over the message limit, or under it)."""
    return st.one_of(st.text(max_size=max_size), st.just(""), st.sampled_from(["<image>", "Hello", " ", "\x00"]),
                     st.builds(lambda c, n: c * n, st.sampled_from("a\u00e9\U0001f600 "),
                               st.sampled_from([5000, 70000, 300000])))


def encoded(fmt: str, mode: str, size: tuple[int, int], fill: int) -> bytes:
    buf = io.BytesIO()
    PIL.Image.new(mode, size, fill).save(buf, fmt)
    return buf.getvalue()


@st.composite
def valid_images(draw) -> pb.Image:
    """An image the server takes: several formats and modes, sizes from 1 pixel to odd aspect ratios."""
    fmt, mode = draw(st.sampled_from([("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "L"), ("PNG", "P"), ("PNG", "I;16"),
                                      ("PNG", "1"), ("JPEG", "RGB"), ("JPEG", "CMYK"), ("JPEG", "L"), ("GIF", "P"),
                                      ("BMP", "RGB"), ("WEBP", "RGBA"), ("TIFF", "F"), ("PNG", "LA")]))
    size = (draw(st.integers(1, 80)), draw(st.sampled_from([1, 2, 7, 33, 80, 300])))
    mime = draw(st.sampled_from(["", f"image/{fmt.lower()}", "image/png"]))
    return pb.Image(data=encoded(fmt, mode, size, draw(st.integers(0, 255))), mime_type=mime)


@st.composite
def bad_images(draw) -> pb.Image:
    """Header-only bombs, truncated files, random or empty bytes, wrong MIME types."""
    kind = draw(st.sampled_from(["bomb", "truncated", "random", "empty", "mime"]))
    if kind == "bomb":
        data = png_header_only(draw(st.sampled_from([0, 1, 600, 4096, 2 ** 31 - 1])),
                               draw(st.sampled_from([0, 1, 600])))
    elif kind == "truncated":
        whole = encoded(draw(st.sampled_from(["PNG", "JPEG"])), "RGB", (32, 32), 7)
        data = whole[: draw(st.integers(1, len(whole) - 1))]
    elif kind == "mime":
        data = encoded("PNG", "RGB", (8, 8), 1)
    else:
        data = draw(st.binary(max_size=200)) if kind == "random" else b""
    mime = draw(st.sampled_from(["", "image/png", "text/plain", "IMAGE/WEBP", "image/", "\x00", "application/pdf"]))
    return pb.Image(data=data, mime_type=mime)


def sampling_field(name: str, wild: bool) -> st.SearchStrategy:
    """A value of one ``SamplingParams`` field (None: unset): in range when tame, anything the wire takes when wild."""
    tame = {"temperature": st.sampled_from([None, 0.0, 0.7, 1.0, 2.0]), "top_p": st.sampled_from([None, 0.5, 1.0]),
            "top_k": st.sampled_from([None, -1, 0, 1, 5]), "max_tokens": st.sampled_from([None, 1, 2]),
            "min_tokens": st.sampled_from([0, 1]),
            "stop_token_ids": st.lists(st.integers(0, DEMO_VOCAB - 1), max_size=2),
            "stop": st.lists(st.sampled_from(["a", "\n", " the"]), max_size=2), "ignore_eos": st.booleans(),
            "seed": st.one_of(st.none(), st.integers(0, 2 ** 32)),
            "presence_penalty": st.sampled_from([None, 0.0, 1.5, -2.0]),
            "frequency_penalty": st.sampled_from([None, 0.0, 0.5, 2.0]),
            "repetition_penalty": st.sampled_from([None, 1.0, 1.3, 0.5]), "logprobs": st.sampled_from([None, 0, 2, 20]),
            "n": st.sampled_from([0, 1, 2, 3]), "prompt_logprobs": st.sampled_from([None, None, 0, 3])}
    edges = (DEMO_VOCAB, DEMO_VOCAB + 1, DEMO_IMAGE_TOKEN, 2, 3)
    wilds = {"temperature": floats(), "top_p": floats(), "top_k": ints(*INT32, edges),
             "max_tokens": ints(*INT32, edges), "min_tokens": ints(*INT32, edges),
             "stop_token_ids": st.lists(ints(*INT32, edges), max_size=4), "stop": st.lists(texts(8), max_size=3),
             "ignore_eos": st.booleans(), "seed": ints(*INT64), "presence_penalty": floats(),
             "frequency_penalty": floats(), "repetition_penalty": floats(), "logprobs": ints(*INT32, (20, 21)),
             "n": ints(0, 2 ** 32 - 1, (16, 17)), "prompt_logprobs": ints(*INT32, (20, 21))}
    return (wilds if wild else tame)[name]


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop_token_ids", "stop",
                   "ignore_eos", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "n",
                   "prompt_logprobs")
REQUEST_FIELDS = ("api_version", "request_id", "model", "input", "images", *SAMPLING_FIELDS)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A valid request with up to three of its fields drawn wild (so each validator is met alone and together)."""
    wild = draw(st.sets(st.sampled_from(REQUEST_FIELDS), max_size=3))

    def pick(name: str, tame: st.SearchStrategy, bad: st.SearchStrategy):
        return draw(bad if name in wild else tame)

    req = pb.GenerateRequest(
        api_version=pick("api_version", st.sampled_from([0, 1, API_VERSION]),
                         st.sampled_from([API_VERSION + 1, 2 ** 32 - 1])),
        request_id=pick("request_id", st.one_of(st.just(""), st.uuids().map(str)),
                        st.one_of(st.text(max_size=20), st.sampled_from(["r" * 200, "a\nb", "\u00e9"]))),
        model=pick("model", st.sampled_from(["", "duet-demo"]), st.sampled_from(["gpt-4", "\U0001f600", " duet-demo"])),
        raw_prompt=draw(st.booleans()))
    good = draw(st.lists(valid_images(), max_size=2))
    marks = len(good)
    if "images" in wild:
        bad = draw(st.lists(bad_images(), min_size=1, max_size=2))
        req.images.extend(draw(st.permutations(good + bad)))
        marks = draw(st.sampled_from([len(good) + len(bad), len(good), 0, 5]))
    else:
        req.images.extend(good)
    fields = {n: pick(n, sampling_field(n, False), sampling_field(n, True)) for n in SAMPLING_FIELDS}
    req.sampling.CopyFrom(pb.SamplingParams(**{k: v for k, v in fields.items() if v is not None}))
    kind = draw(st.sampled_from(["prompt", "prompt", "token_ids", "chat", *(["none"] if "input" in wild else [])]))
    text = pick("input", st.sampled_from(["Hello", "Describe the image.", "1 2 3"]), texts())
    if kind == "prompt":
        req.prompt = "<image>" * marks + text
    elif kind == "token_ids":
        tame_ids = st.lists(st.integers(5, DEMO_VOCAB - 1), min_size=1, max_size=20)
        wild_ids = st.lists(st.one_of(st.integers(0, DEMO_VOCAB - 1), st.just(DEMO_IMAGE_TOKEN),
                                      ints(*INT32, (DEMO_VOCAB,))), max_size=draw(st.sampled_from([0, 10, 300])))
        req.prompt_token_ids.ids.extend([DEMO_IMAGE_TOKEN] * (DEMO_IMAGE_TOKENS * marks)
                                        + pick("input", tame_ids, wild_ids))
    elif kind == "chat":
        turns = [pb.ChatMessage(role="user", content="<image>" * marks + text)]
        if "input" in wild:
            roles = st.sampled_from(["user", "system", "assistant", "tool", "", "USER", "\x00"])
            turns = draw(st.permutations(turns + draw(st.lists(st.builds(pb.ChatMessage, role=roles, content=texts()),
                                                                max_size=3))))
        req.chat.messages.extend(turns)
    return req


def unknown_fields() -> st.SearchStrategy[bytes]:
    """Wire bytes of fields this server does not know (field numbers 100..5000, each wire type)."""
    def field(number: int, wire: int, payload: bytes) -> bytes:
        key, out = (number << 3) | wire, bytearray()
        while True:
            out.append((key & 0x7F) | (0x80 if key > 0x7F else 0))
            key >>= 7
            if not key:
                return bytes(out) + payload
    varint = st.builds(lambda n: field(n, 0, b"\x01"), st.integers(100, 5000))
    blob = st.builds(lambda n, b: field(n, 2, bytes([len(b)]) + b), st.integers(100, 5000), st.binary(max_size=100))
    return st.lists(st.one_of(varint, blob), max_size=3).map(b"".join)


# ------------------------------------------------------------------------------------------------------ the calls
def raw_call(channel: grpc.Channel, method: str, stream: bool):
    kw = {"request_serializer": None, "response_deserializer": None}
    return (channel.unary_stream if stream else channel.unary_unary)(f"/duet.v1.Duet/{method}", **kw)


def expect_typed(e: grpc.RpcError, cancelled: bool = False, sent: object = None) -> str:
    code = e.code()
    allowed = TYPED | ({grpc.StatusCode.CANCELLED} if cancelled else set())
    assert code in allowed and e.details(), (code, e.details(), str(sent)[:2000])
    return f"grpc {code.name}"


def generate(channel: grpc.Channel, req: pb.GenerateRequest, extra: bytes, action: str) -> str:
    """One Generate call (wire bytes: the message then ``extra``); ``action``: "read", "cancel" (after the first
    reply) or "abort" (by id, from another call, after the first reply)."""
    rid = req.request_id or uuid.uuid4().hex if action == "abort" else req.request_id
    if action == "abort":
        req.request_id = rid
    call = raw_call(channel, "Generate", stream=True)(req.SerializeToString() + extra, metadata=MD, timeout=60)
    replies = []
    try:
        for raw in call:
            replies.append(pb.GenerateResponse.FromString(raw))
            if len(replies) == 1 and action == "cancel":
                call.cancel()
            if len(replies) == 1 and action == "abort":
                found = pb.AbortResponse.FromString(raw_call(channel, "Abort", False)(
                    pb.AbortRequest(request_id=rid).SerializeToString(), metadata=MD, timeout=30))
                assert isinstance(found.found, bool)
    except grpc.RpcError as e:
        return expect_typed(e, cancelled=action == "cancel", sent=req)
    kinds = [r.WhichOneof("kind") for r in replies]
    assert kinds and kinds[-1] == "final" and all(k == "delta" for k in kinds[:-1]), kinds
    assert all(r.api_version == API_VERSION for r in replies)
    return f"grpc OK {pb.FinishReason.Name(replies[-1].final.finish_reason)}"


def unary(channel: grpc.Channel, method: str, body: bytes) -> str:
    try:
        raw_call(channel, method, stream=False)(body, metadata=MD, timeout=30)
    except grpc.RpcError as e:
        return expect_typed(e)
    return f"grpc OK {method}"


# ------------------------------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def server(serve_cluster):
    with serving(serve_cluster, TALLY, "gRPC fuzz") as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target, options=[("grpc.max_send_message_length", 1 << 24)]) as ch:
        yield ch


def test_fuzz_generate(server, channel, serve_cluster):
    @fuzz_settings(round(total_examples() * 0.8))
    @given(req=generate_requests(), extra=st.one_of(st.just(b""), unknown_fields()),
           action=st.sampled_from(["read", "read", "read", "cancel", "abort"]))
    def run(req, extra, action):
        TALLY.add(generate(channel, req, extra, action))

    run()
    assert_cluster_clean(server, serve_cluster)


UNARY = {"Abort": st.builds(pb.AbortRequest, api_version=st.integers(0, 2 ** 32 - 1), request_id=texts()),
         "ListModels": st.builds(pb.ListModelsRequest, api_version=st.integers(0, 2 ** 32 - 1)),
         "ClusterStatus": st.builds(pb.ClusterStatusRequest, api_version=st.integers(0, 2 ** 32 - 1))}


def test_fuzz_unary_and_garbage(server, channel, serve_cluster):
    """The three unary RPCs with their messages (and unknown fields), and random bytes to every method."""
    methods = st.sampled_from([*UNARY, "Generate"])

    @fuzz_settings(round(total_examples() * 0.2))
    @given(data=st.data(), method=methods, garbage=st.booleans(), extra=unknown_fields())
    def run(data, method, garbage, extra):
        if garbage or method == "Generate":
            body = data.draw(st.binary(max_size=64))
            if method == "Generate":
                return TALLY.add(generate_garbage(channel, body))
        else:
            body = data.draw(UNARY[method]).SerializeToString() + extra
        TALLY.add(unary(channel, method, body))

    run()
    assert_cluster_clean(server, serve_cluster)


def generate_garbage(channel: grpc.Channel, body: bytes) -> str:
    try:
        replies = list(raw_call(channel, "Generate", stream=True)(body, metadata=MD, timeout=60))
    except grpc.RpcError as e:
        return expect_typed(e)
    assert replies and pb.GenerateResponse.FromString(replies[-1]).WhichOneof("kind") == "final"
    return "grpc OK garbage"


def test_concurrent_duplicate_ids_are_refused_typed(server, channel):
    """Two calls with one request id at once: one runs, the other is INVALID_ARGUMENT (never both, never INTERNAL)."""
    req = pb.GenerateRequest(request_id="dup-1", prompt="Hello", raw_prompt=True,
                             sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    out: list[str] = []
    threads = [threading.Thread(target=lambda: out.append(generate(channel, pb.GenerateRequest.FromString(
        req.SerializeToString()), b"", "read"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(out) == 4 and all(o in ("grpc OK FINISH_REASON_LENGTH", "grpc INVALID_ARGUMENT") for o in out), out
    assert "grpc OK FINISH_REASON_LENGTH" in out


# ------------------------------------------------------------------------------- regressions (bugs the fuzz found)
def test_a_request_id_that_cannot_be_metadata_is_invalid_argument(channel):
    """It went back as ``x-request-id`` metadata, which grpc refused: INTERNAL."""
    for rid in ("\u00e9", "a\nb"):
        assert generate(channel, pb.GenerateRequest(request_id=rid, prompt="Hi"), b"", "read") == \
            "grpc INVALID_ARGUMENT"


def test_bytes_that_do_not_parse_are_invalid_argument(channel):
    """grpc's own answer to a request its deserializer cannot parse is UNKNOWN."""
    assert generate_garbage(channel, b"\xff\xff") == "grpc INVALID_ARGUMENT"
    assert all(unary(channel, method, b"\xff\xff") == "grpc INVALID_ARGUMENT" for method in UNARY)


def test_an_id_may_be_reused_as_soon_as_its_call_ended(channel, serve_cluster):
    """The workers may still hold the old request's transfer when the next call with its id arrives: the cluster
    refused it as a duplicate transfer (INTERNAL). A call still running under that id is INVALID_ARGUMENT."""
    req = pb.GenerateRequest(request_id="again", prompt="Hello", raw_prompt=True,
                             sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    outs = [generate(channel, pb.GenerateRequest.FromString(req.SerializeToString()), b"", action)
            for action in ("cancel", "read", "cancel", "cancel", "read", "read")]
    assert set(outs) <= {"grpc CANCELLED", "grpc OK FINISH_REASON_LENGTH", "grpc INVALID_ARGUMENT"}, outs
    assert outs[-1] == "grpc OK FINISH_REASON_LENGTH"
    wait_idle(serve_cluster)


def test_n_choices_that_all_end_with_their_first_token_all_come_back(channel, serve_cluster):
    """max_tokens 1 with n > 1: every choice ends in the commit of the hand-off, whose first event said the request
    had finished, so the front-end stopped reading before the other choices' ends (INTERNAL: stream ended)."""
    req = pb.GenerateRequest(prompt="Hello", raw_prompt=True, api_version=API_VERSION,
                             sampling=pb.SamplingParams(n=3, max_tokens=1, ignore_eos=True))
    replies = list(raw_call(channel, "Generate", stream=True)(req.SerializeToString(), metadata=MD, timeout=60))
    final = pb.GenerateResponse.FromString(replies[-1]).final
    assert sorted(c.index for c in final.choices) == [0, 1, 2] and final.usage.completion_tokens == 3
    deltas = [pb.GenerateResponse.FromString(r).delta for r in replies[:-1]]
    assert sorted(d.index for d in deltas) == [0, 1, 2] and all(len(d.token_ids) == 1 for d in deltas)
    wait_idle(serve_cluster)
