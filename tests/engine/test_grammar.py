"""Structured outputs in the engine (engine.grammar): sampled outputs under a grammar always match it, locally and
across the prefill -> decode hand-off (LocalPair: the decode side's matcher is advanced by prefill's first token);
rows with different grammars share a batch; a bad spec changes nothing; truncation only at max_tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import EngineConfig, SamplingParams
from engine.errors import InvalidRequestError
from engine.grammar import GrammarError, validate
from engine.grammar_spec import StructuredOutputsParams as Structured
from tests.conftest import LLM_DEFAULTS, assert_no_leaked_blocks

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}, "tag": {"enum": ["ab", "cde"]},
                                           "name": {"type": "string", "pattern": "^[a-z]{0,4}$"}},
          "required": ["n", "ok", "tag", "name"], "additionalProperties": False}
PROMPT = {"prompt_token_ids": [253, 11, 12, 13, 14]}


def _sampled(n: int, spec: Structured, max_tokens: int = 48) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=max_tokens, structured_outputs=spec)
            for i in range(n)]


def _check_json(outs, schema=SCHEMA) -> None:
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_json_schema_outputs_validate_locally(make_llm):
    llm = make_llm()
    _check_json(llm.generate([PROMPT] * 50, _sampled(50, Structured(json=SCHEMA))))


def test_json_schema_outputs_validate_across_the_handoff(tiny_model_dir):
    from cluster.control.local_pair import LocalPair

    cfg = {**LLM_DEFAULTS, "num_kv_blocks": 1024, "max_num_seqs": 16}
    pair = LocalPair(tiny_model_dir, EngineConfig(**cfg))
    outs, failed = pair.generate([PROMPT] * 50, _sampled(50, Structured(json=SCHEMA)))
    assert not failed
    _check_json(outs)
    assert_no_leaked_blocks(pair.prefill.engine)
    assert_no_leaked_blocks(pair.decode.engine)


def test_rows_with_different_grammars_share_a_batch(make_llm):
    llm = make_llm()
    specs = [Structured(choice=["yes", "no", "maybe"]), Structured(regex=r"[0-9]{3}-[a-c]{2}"),
             Structured(json=SCHEMA), None]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs=specs[i % 4])
              for i in range(16)]
    outs = llm.generate([PROMPT] * 16, params)
    for i, o in enumerate(outs):
        c = o.outputs[0]
        if i % 4 == 0:
            assert c.text in ("yes", "no", "maybe") and c.finish_reason == "stop"
        elif i % 4 == 1:
            assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", c.text) and c.finish_reason == "stop"
        elif i % 4 == 2:
            _check_json([o])


def test_truncation_only_at_max_tokens(make_llm):
    llm = make_llm()
    outs = llm.generate([PROMPT] * 4, _sampled(4, Structured(json=SCHEMA), max_tokens=3))  # needs more than 3
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
    assert all(o.outputs[0].text.startswith('{"') for o in outs)
    done = llm.generate([PROMPT] * 4, _sampled(4, Structured(json_object=True), max_tokens=64))
    for o in done:  # any object: EOS is allowed as soon as one closes
        assert o.outputs[0].finish_reason == "length" or isinstance(json.loads(o.outputs[0].text), dict)


def test_grammar_wins_over_min_tokens(make_llm):
    llm = make_llm()
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=8, min_tokens=8,
                             structured_outputs=Structured(choice=["ab", "ba"])) for i in range(3)]
    for o in llm.generate([PROMPT] * 3, params):
        assert o.outputs[0].text in ("ab", "ba")  # what follows the completed choice can only be EOS


@pytest.mark.parametrize("spec", [Structured(json={"type": "objekt"}), Structured(json='{"type": "object", '
                                  '"properties": {"a": {"$ref": "#/nowhere"}}}'), Structured(regex="(unclosed"),
                                  Structured(grammar="start: undefined_rule")], ids=["type", "ref", "regex", "lark"])
def test_bad_spec_is_a_typed_error_and_changes_nothing(make_llm, spec):
    with pytest.raises(GrammarError):
        validate(spec)
    llm = make_llm()
    with pytest.raises(GrammarError):
        llm.engine.add_request("bad", PROMPT, SamplingParams(structured_outputs=spec))
    with pytest.raises(GrammarError):
        llm.engine.preallocate("bad", PROMPT, SamplingParams(structured_outputs=spec))
    assert not llm.engine.requests and not llm.engine.receiving  # make_llm asserts no block is held


def test_spec_takes_exactly_one_kind_and_survives_the_wire():
    from node_common import messages

    with pytest.raises(InvalidRequestError):
        Structured(json=SCHEMA, regex="a")
    with pytest.raises(InvalidRequestError):
        Structured()
    p = SamplingParams(structured_outputs=Structured(json=SCHEMA))
    back = messages.params_from_dict(messages.unpack(messages.pack(p=messages.params_to_dict(p)))["p"])
    assert back.structured_outputs == p.structured_outputs and json.loads(back.structured_outputs.json) == SCHEMA


def test_a_token_the_grammar_refuses_fails_that_request_not_stops_it(make_llm, monkeypatch):
    """Were a token the mask forbids ever appended (a defect: here the mask lets everything through), the request
    ends with finish_reason "error" and the grammar's reason, not as a "stop" with output that breaks its
    constraint; a request of the same batch without a grammar is untouched."""
    from engine.grammar import GrammarProcessor

    llm = make_llm()
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([PROMPT], [free])[0].outputs[0].token_ids

    def allow_all(self, mask, i):
        mask[i].fill_(-1)  # every bit set: every token allowed

    monkeypatch.setattr(GrammarProcessor, "fill", allow_all)
    bad = SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                         structured_outputs=Structured(choice=["yes", "no"]))
    outs = llm.generate([PROMPT, PROMPT], [bad, free])
    c = outs[0].outputs[0]
    assert c.finish_reason == "error", (c.finish_reason, c.text)
    assert "grammar_violation" in (outs[0].error or "") or "GrammarViolationError" in (outs[0].error or ""), outs[0]
    assert outs[1].outputs[0].token_ids == want and outs[1].outputs[0].finish_reason == "length"
    assert_no_leaked_blocks(llm.engine)
