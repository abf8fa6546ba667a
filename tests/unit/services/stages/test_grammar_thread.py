"""Grammar compiles in a stage or the ingress: never on the event loop or the default worker threads — on one niced
thread of their own, skipped when the grammar is cached; a constraint that cannot be served raises its 400."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from common.errors import InvalidRequestError
from common.grammar.compiler import compiler_for
from common.grammar.formats import guide_from_request
from services.stages import threads


def test_a_compile_runs_on_the_niced_grammar_thread_and_a_cached_one_does_not_hop(tiny_llava, monkeypatch):
    compiler = compiler_for(tiny_llava)
    seen: list[tuple[str, int]] = []
    check = compiler.check

    def spy(guide):
        seen.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return check(guide)

    monkeypatch.setattr(compiler, "check", spy)
    guide = guide_from_request({"guided_regex": "grammar-thread-[0-9]{3}"}, 1024)

    async def twice():
        await threads.compile_guide(tiny_llava, guide)
        await threads.compile_guide(tiny_llava, guide)  # cached now: no hop, no check
        await threads.compile_guide(tiny_llava, None)

    asyncio.run(twice())
    assert len(seen) == 1 and seen[0][0].startswith("prism-grammar") and seen[0][1] >= threads.GRAMMAR_NICE


def test_a_constraint_that_cannot_be_served_raises_its_400(tiny_llava):
    guide = guide_from_request({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, 1024)
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(threads.compile_guide(tiny_llava, guide))
    assert info.value.code == "invalid_response_format" and info.value.param == "guided_json"
