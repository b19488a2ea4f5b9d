"""engine.tokenizer against transformers' AutoTokenizer / LlavaProcessor on tiny locally-trained tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import PIL.Image
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlavaProcessor, SiglipImageProcessorPil

from engine.errors import CheckpointError, InvalidRequestError, TokenOutOfVocabError
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "hello world, this is a test.",
    "the quick brown fox jumps over the lazy dog",
    "What is shown in this image? Describe it in detail.",
    "A cat sits on a red mat; the dog doesn't care.",
    "naïve café résumé — 東京 🙂",
]
TEXTS = [
    "hello world",
    "What is in this image? A cat!",
    "  leading and trailing spaces  ",
    "special <s> inside </s> text <pad>",
    "unseen words: zebra quokka 42",
    "naïve café 東京 🙂🙂",
    "",
]
KINDS = ["bytelevel-bpe", "metaspace-bpe", "wordpiece"]


def _build(kind: str, with_image_token: bool = True) -> BackendTokenizer:
    """A small trained tokenizer: GPT-2 style, Llama style (BOS only) or BERT style ([CLS] x [SEP])."""
    image = ["<image>"] if with_image_token else []
    if kind == "wordpiece":
        tok = BackendTokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
            vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]", *image]))
        tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                       ("[CLS]", tok.token_to_id("[CLS]")))
        return tok
    tok = BackendTokenizer(models.BPE(unk_token="<unk>" if kind == "metaspace-bpe" else None))
    if kind == "bytelevel-bpe":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>", *image], initial_alphabet=alphabet))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def _checkpoint(path: Path, kind: str, *, with_image_token: bool = True, config: dict | None = None,
                generation_config: dict | None = None) -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ generation_config.json) into ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    _build(kind, with_image_token).save(str(path / "tokenizer.json"))
    if kind == "wordpiece":
        base = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                "clean_up_tokenization_spaces": True}
    else:
        base = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (path / "tokenizer_config.json").write_text(json.dumps(base | (config or {})))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def pair(tmp_path: Path, kind: str) -> tuple[Tokenizer, object]:
    path = _checkpoint(tmp_path, kind)
    return Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_encode_decode_match_transformers(pair: tuple[Tokenizer, object]) -> None:
    ours, ref = pair
    assert ours.vocab_size == len(ref)
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == ref.encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.token_to_id("<image>") == ref.convert_tokens_to_ids("<image>")
    assert ours.token_to_id("no-such-token") is None


def test_bytelevel_decode_round_trips(tmp_path: Path) -> None:
    ours = Tokenizer.from_pretrained(_checkpoint(tmp_path, "bytelevel-bpe"))
    for text in TEXTS:
        assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_encode_with_images_matches_reference_expansion(pair: tuple[Tokenizer, object], num_images: int) -> None:
    ours, ref = pair
    image_id = ours.token_to_id("<image>")
    prompts = [
        "".join(f"<image> picture {i}: " for i in range(num_images)) + "what is shown?",
        "USER: " + "<image>" * num_images + "\nCompare them. ASSISTANT:",
    ]
    for prompt in prompts:
        ids, found = ours.encode_with_images(prompt, image_token="<image>", image_token_id=image_id, tokens_per_image=5)
        assert found == num_images
        assert ids == ref.encode(prompt.replace("<image>", "<image>" * 5))
        assert ids.count(image_id) == 5 * num_images


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_encode_with_images_matches_llava_processor(tmp_path: Path, num_images: int) -> None:
    path = _checkpoint(tmp_path, "bytelevel-bpe")
    processor = LlavaProcessor(image_processor=SiglipImageProcessorPil(size={"height": 28, "width": 28}),
                               tokenizer=AutoTokenizer.from_pretrained(path), patch_size=14,
                               vision_feature_select_strategy="full")  # 2 x 2 patches: 4 tokens per image
    prompt = "USER: " + "<image>\n" * num_images + "Describe the scene. ASSISTANT:"
    images = [PIL.Image.new("RGB", (40, 30), (i * 40, 0, 0)) for i in range(num_images)] or None
    expected = processor(images=images, text=prompt)["input_ids"][0]
    ours = Tokenizer.from_pretrained(path)
    ids, found = ours.encode_with_images(prompt, image_token="<image>", image_token_id=ours.token_to_id("<image>"),
                                         tokens_per_image=4)
    assert (ids, found) == (list(expected), num_images)


def test_encode_with_images_splices_when_placeholder_is_not_a_token(tmp_path: Path) -> None:
    ours = Tokenizer.from_pretrained(_checkpoint(tmp_path, "metaspace-bpe", with_image_token=False))
    assert ours.token_to_id("<image>") is None
    image_id = ours.vocab_size  # the model's own image token, outside the text vocabulary
    ids, found = ours.encode_with_images("<image>a cat<image><image> and a dog", image_token="<image>",
                                         image_token_id=image_id, tokens_per_image=2)
    piece = lambda text: ours.encode(text, add_special_tokens=False)  # noqa: E731
    assert found == 3
    assert ids == [ours.bos_token_id, *[image_id] * 2, *piece("a cat"), *[image_id] * 4, *piece(" and a dog")]


def test_encode_with_images_splices_bert_affixes(tmp_path: Path) -> None:
    ours = Tokenizer.from_pretrained(_checkpoint(tmp_path, "wordpiece", with_image_token=False))
    cls_id, sep_id = ours.token_to_id("[CLS]"), ours.token_to_id("[SEP]")
    ids, found = ours.encode_with_images("hello <image> world", image_token="<image>", image_token_id=999,
                                         tokens_per_image=1)
    assert found == 1
    assert ids == [cls_id, *ours.encode("hello ", add_special_tokens=False), 999,
                   *ours.encode(" world", add_special_tokens=False), sep_id]


def test_image_token_named_in_config_is_added_like_transformers(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, "bytelevel-bpe", with_image_token=False, config={"image_token": "<image>"})
    ours, ref = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert ours.token_to_id("<image>") == ref.convert_tokens_to_ids("<image>") is not None
    assert ours.vocab_size == len(ref)
    for text in ["a <image> b", "<image><image>x"]:
        assert ours.encode(text) == ref.encode(text)


def test_extra_special_tokens_added_like_transformers(tmp_path: Path) -> None:
    extra = {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "mask_token": "<mask>"}
    path = _checkpoint(tmp_path, "metaspace-bpe", config=extra)
    ours, ref = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert ours.vocab_size == len(ref)
    for text in ["<|im_start|>user hello<|im_end|>", "a<mask>b <|im_end|>"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_encode_with_images_rejects_bad_arguments(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    image_id = ours.token_to_id("<image>")
    with pytest.raises(InvalidRequestError):
        ours.encode_with_images("x", image_token="", image_token_id=image_id, tokens_per_image=4)
    with pytest.raises(InvalidRequestError):
        ours.encode_with_images("x", image_token="<image>", image_token_id=image_id, tokens_per_image=0)
    with pytest.raises(CheckpointError):
        ours.encode_with_images("<image>", image_token="<image>", image_token_id=image_id + 1, tokens_per_image=4)


@pytest.mark.parametrize(
    ("generation_config", "expected"),
    [(None, [2]), ({"eos_token_id": 7}, [7]), ({"eos_token_id": [2, 9]}, [2, 9]), ({"bos_token_id": 1}, [2])],
    ids=["from-tokenizer-config", "int", "list", "no-eos-in-generation-config"],
)
def test_eos_token_ids(tmp_path: Path, generation_config: dict | None, expected: list[int]) -> None:
    ours = Tokenizer.from_pretrained(_checkpoint(tmp_path, "bytelevel-bpe", generation_config=generation_config))
    assert ours.token_to_id("</s>") == 2
    assert ours.eos_token_ids == expected
    assert ours.bos_token_id == ours.token_to_id("<s>") == 1


def test_no_eos_anywhere_gives_empty_list(tmp_path: Path) -> None:
    ours = Tokenizer.from_pretrained(_checkpoint(tmp_path, "wordpiece"))
    assert ours.eos_token_ids == [] and ours.bos_token_id is None


def test_special_tokens_map_is_read_for_legacy_configs(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, "bytelevel-bpe")
    (path / "tokenizer_config.json").write_text("{}")
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    assert Tokenizer.from_pretrained(path).eos_token_ids == [2]


@pytest.mark.parametrize(
    ("name", "content"),
    [(None, None), ("tokenizer.json", "{broken"), ("tokenizer_config.json", "[1]"),
     ("generation_config.json", "not json"), ("generation_config.json", '{"eos_token_id": "</s>"}')],
    ids=["missing-tokenizer-json", "broken-tokenizer-json", "config-not-object", "bad-generation-config", "bad-eos"],
)
def test_bad_checkpoint_raises_checkpoint_error(tmp_path: Path, name: str | None, content: str | None) -> None:
    path = _checkpoint(tmp_path, "bytelevel-bpe", generation_config={})
    if name is None:
        (path / "tokenizer.json").unlink()
    else:
        (path / name).write_text(content)
    with pytest.raises(CheckpointError):
        Tokenizer.from_pretrained(path)


def test_decode_rejects_negative_ids_and_skips_unknown(pair: tuple[Tokenizer, object]) -> None:
    ours, _ = pair
    with pytest.raises(TokenOutOfVocabError):
        ours.decode([5, -1])
    ids = ours.encode("hello world", add_special_tokens=False)
    assert ours.decode([*ids, ours.vocab_size + 10]) == ours.decode(ids)


def test_chat_template_matches_transformers(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
        "{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    )
    path = _checkpoint(tmp_path, "bytelevel-bpe", config={"chat_template": template})
    ours, ref = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "<image>\nWhat is this?"}, {"role": "assistant", "content": "A cat."},
                {"role": "user", "content": "Sure?"}]
    for add in (True, False):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected
    with pytest.raises(InvalidRequestError, match="bad role"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_jinja_file_takes_priority(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, "bytelevel-bpe", config={"chat_template": "config"})
    (path / "chat_template.jinja").write_text("file:{{ messages | length }}")
    assert Tokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "hi"}]) == "file:1"


def test_no_chat_template_returns_none(tmp_path: Path) -> None:
    assert Tokenizer.from_pretrained(_checkpoint(tmp_path, "wordpiece")).apply_chat_template([]) is None


def _stream(tokenizer: Tokenizer, ids: list[int], chunk: int = 1, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.finish()]


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_deltas_concatenate_to_decode(pair: tuple[Tokenizer, object], chunk: int) -> None:
    ours, _ = pair
    for text in TEXTS:
        ids = ours.encode(text)
        for skip in (True, False):
            deltas = _stream(ours, ids, chunk, skip_special_tokens=skip)
            assert "".join(deltas) == ours.decode(ids, skip_special_tokens=skip), text
            assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_split_utf8(tmp_path: Path) -> None:
    ours = Tokenizer.from_pretrained(_checkpoint(tmp_path, "bytelevel-bpe"))
    ids = ours.encode("ok 🦜", add_special_tokens=False)  # unseen emoji: its 4 bytes span the last 3 tokens
    assert _stream(ours, ids) == ["o", "k", "", "", " 🦜", ""]
    detok = IncrementalDetokenizer(ours)
    assert detok.push(ids[:2]) == "ok"
    assert detok.push(ids[2:-1]) == ""  # incomplete character: held back
    # if the stream ends there, the partial bytes are flushed as the replacement character decode() gives them
    assert detok.finish() == ours.decode(ids[:-1])[2:] == " \ufffd"


def test_incremental_detokenizer_with_prompt_context(tmp_path: Path) -> None:
    ours = Tokenizer.from_pretrained(_checkpoint(tmp_path, "metaspace-bpe"))
    prompt = ours.encode("the quick brown fox jumps over")
    generated = ours.encode("the quick brown fox jumps over the lazy dog")[len(prompt) :]
    assert "".join(_stream(ours, generated, prompt_ids=prompt)) == " the lazy dog"
    assert ours.decode(generated) == "the lazy dog"  # alone, the Metaspace decoder drops the leading space


@settings(max_examples=60, deadline=None, database=None)
@given(text=st.text(alphabet=st.sampled_from("ab é東🙂\n<s>"), max_size=40), chunk=st.integers(1, 4))
def test_incremental_detokenizer_property(bytelevel_tokenizer: Tokenizer, text: str, chunk: int) -> None:
    ids = bytelevel_tokenizer.encode(text)
    assert "".join(_stream(bytelevel_tokenizer, ids, chunk)) == bytelevel_tokenizer.decode(ids)


@pytest.fixture(scope="module")
def bytelevel_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(_checkpoint(tmp_path_factory.mktemp("bl"), "bytelevel-bpe"))


def test_chat_template_is_compiled_once_and_again_when_it_changes(tmp_path: Path) -> None:
    """The template is compiled once per text (not per request); a new text is compiled afresh, and a template that
    does not compile is a clear error on every call."""
    path = _checkpoint(tmp_path, "bytelevel-bpe", config={"chat_template": "A:{{ messages | length }}"})
    tok = Tokenizer.from_pretrained(path)
    one = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(one) == "A:1"
    compiled = tok._compiled_template()
    assert tok.apply_chat_template(one + one) == "A:2" and tok._compiled_template() is compiled
    tok.chat_template = "B:{{ messages[0]['content'] }}"
    assert tok.apply_chat_template(one) == "B:hi" and tok._compiled_template() is not compiled
    tok.chat_template = "{% for m in messages %}"  # never closed
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="chat template failed"):
            tok.apply_chat_template(one)
