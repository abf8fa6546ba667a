"""Grammar-constrained decoding in the engines: every reply obeys its guide, prefill's first token included; guided
and free sequences batch together and the free ones are unchanged; batched equals alone; replays rebuild the
grammar's state."""

from __future__ import annotations

import json
import re

import jsonschema

from common.engine.decode import DecodeEngine
from common.grammar.formats import guide_from_request
from common.kv.pool import KVPool
from common.protocol.sampling import SamplingParams
from common.reference.decode import decode
from common.reference.prefill import prefill
from common.stages.merge import merge
from common.stages.prompt import build_prompt

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _guide(body):
    return guide_from_request(body, 1 << 16)


def _sampling(i: int, guide) -> SamplingParams:
    update = {"temperature": 0.9, "top_p": 0.95, "seed": i} if i % 3 == 1 else {}
    if i % 3 == 2:
        update = {"frequency_penalty": 0.7}
    return SamplingParams(max_tokens=60, guide=guide, **update)


def _prefilled(lm, i: int, sampling: SamplingParams):
    text = [{"type": "text", "text": f"Request {i}: describe a person as JSON."}]
    prompt = build_prompt(lm, [{"role": "user", "content": text}], [], 4096)
    return prefill(lm, merge(lm, prompt, []), sampling, 16)


def _requests(lm):
    guides = [
        _guide({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}),
        None,
        _guide({"structured_outputs": {"regex": "[a-z]{2,6}-[0-9]{1,3}"}}),
        _guide({"guided_choice": ["yes", "no", "maybe so"]}),
        None,
        _guide({"response_format": {"type": "json_object"}}),
    ]
    out = []
    for i in range(12):
        sampling = _sampling(i, guides[i % len(guides)])
        out.append((f"req-{i}", _prefilled(lm, i, sampling), sampling))
    return out


def _run(engine: DecodeEngine, requests) -> dict[str, list]:
    got: dict[str, list] = {}
    for rid, pre, sp in requests:
        engine.submit(rid, pre, sp)
        for ev in engine.step():  # staggered: sequences join a batch that is already running
            got.setdefault(ev.request_id, []).append((ev.token_id, ev.finish_reason))
    while engine.has_work():
        for ev in engine.step():
            got.setdefault(ev.request_id, []).append((ev.token_id, ev.finish_reason))
    return got


def _check(lm, guide, ids, finish) -> None:
    text = lm.tokenizer.decode(ids, skip_special_tokens=True)
    if finish != "stop":
        assert finish == "length" and len(ids) == 60
        return
    if guide.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif guide.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif guide.kind == "regex":
        assert re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}", text), text
    else:
        assert text in ("yes", "no", "maybe so"), text


def test_guided_and_free_sequences_batch_together_and_match_each_alone(tiny_model):
    lm = tiny_model
    requests = _requests(lm)
    alone = {rid: decode(lm, pre, sp) for rid, pre, sp in requests}
    free = {rid: decode(lm, pre, sp.model_copy(update={"guide": None})) for rid, pre, sp in requests}
    pool = KVPool(256, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=32)
    got = _run(engine, requests)
    stopped = 0
    for rid, _, sp in requests:
        ids = [t for t, _ in got[rid]]
        assert ids == list(alone[rid].token_ids), rid  # batched with other grammars = alone
        if sp.guide is None:
            assert ids == list(free[rid].token_ids), rid  # neighbours' masks never touch a free row
            continue
        _check(lm, sp.guide, ids, got[rid][-1][1])
        stopped += got[rid][-1][1] == "stop"
        assert ids != list(free[rid].token_ids)  # (the grammar did constrain: random weights never say JSON)
    assert stopped >= 6
    assert engine.masks.rows > 0 and engine.masks.seconds > 0
    pool.check_no_leaks()


def test_a_guided_replay_rebuilds_the_grammar_state(tiny_llava):
    """Decode migration: the matcher is advanced by the replayed tokens, so the rest of the reply is what the lost
    replica would have sent, and it still parses."""
    lm = tiny_llava
    requests = [r for r in _requests(lm) if r[2].guide is not None]
    alone = {rid: decode(lm, pre, sp) for rid, pre, sp in requests}
    pool = KVPool(256, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool, max_batch=8)
    got: dict[str, list] = {}
    cut = {}
    for rid, pre, sp in requests:
        cut[rid] = len(alone[rid].token_ids) // 2
        engine.submit(rid, pre, sp, replay=list(alone[rid].token_ids[: cut[rid]]))
    while engine.has_work():
        for ev in engine.step():
            got.setdefault(ev.request_id, []).append(ev.token_id)
    for rid, _, _ in requests:
        assert alone[rid].token_ids[: cut[rid]] + tuple(got[rid]) == alone[rid].token_ids, rid
    assert engine.replay_mismatches == 0 and engine.replayed == sum(cut.values()) > 0
    pool.check_no_leaks()


def test_a_first_token_the_grammar_refuses_errors_the_sequence_and_frees_its_kv(tiny_llava):
    """A hand-off whose first token breaks the guide (a prefill that did not apply it) ends in an error event, not in
    output that breaks the grammar."""
    lm = tiny_llava
    pre = _prefilled(lm, 0, SamplingParams(max_tokens=8))  # sampled without the guide
    first = lm.tokenizer.decode([pre.first_token_id])
    choice = next(c for c in ("~~~", "###") if not (first and c.startswith(first)))
    pool = KVPool(64, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool)
    engine.submit("r", pre, SamplingParams(max_tokens=8, guide=_guide({"guided_choice": [choice]})))
    assert [(e.token_id, e.finish_reason) for e in engine.step()] == [(None, "error")]
    pool.check_no_leaks()


def test_a_reply_complete_at_max_tokens_stops_and_a_failed_grammar_ends_in_an_error(tiny_llava):
    """A grammar complete exactly at its last allowed token says ``stop``, not ``length``; a matcher that fails
    mid-way (a parser limit met at a step: its mask then allows only EOS) ends the sequence with an error event, not
    with ``stop`` on text the grammar did not accept."""
    lm = tiny_llava
    guide = _guide({"guided_choice": ["yes"]})
    pre = _prefilled(lm, 0, SamplingParams(max_tokens=8, guide=guide))
    needed = len(decode(lm, pre, SamplingParams(max_tokens=8, guide=guide)).token_ids)
    exact = SamplingParams(max_tokens=needed, guide=guide)
    assert decode(lm, pre, exact).finish_reason == "stop"
    pool = KVPool(64, 16, lm.kv_shape, lm.dtype)
    engine = DecodeEngine(lm, pool)
    engine.submit("exact", pre, exact)
    got = _run(engine, [])
    assert got["exact"][-1][1] == "stop" and len(got["exact"]) == needed

    long_guide = _guide({"guided_regex": "[a-z]{30,40}"})
    sampling = SamplingParams(max_tokens=30, guide=long_guide)
    engine.submit("failing", _prefilled(lm, 1, sampling), sampling)

    class Failed:  # the library's matcher after a limit: consumes EOS, then reports its error
        def __init__(self, inner):
            self.inner = inner

        def consume_token(self, token):
            return True

        def is_error(self):
            return True

        def get_error(self):
            return "step lexer fuel exhausted"

        def __getattr__(self, name):
            return getattr(self.inner, name)

    engine.step()
    seq = engine._running["failing", 0]
    seq.matcher = Failed(seq.matcher)
    events = [(e.token_id, e.finish_reason) for e in engine.step() if e.request_id == "failing"]
    assert events == [(None, "error")]
    pool.check_no_leaks()
