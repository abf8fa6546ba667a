"""Tool calls (``tools``, ``tool_choice``, ``parallel_tool_calls``), on the grammar machinery of :mod:`common.grammar`.

Lifecycle of one request with tools:

1. **ingress, parse** — :func:`~common.tools.spec.tools_from_request` reads the functions and the choice from the raw
   body (shapes, names, sizes: 400 ``invalid_tools``); the history's earlier calls and tool answers are validated by
   the request schema (:mod:`common.protocol.openai`).
2. **ingress, plan** — the chat template renders the definitions into the prompt (its own format; a template that
   never reads ``tools`` is a 400), and :func:`~common.tools.grammar.tool_guide` turns the choice into one
   :class:`~common.grammar.guide.Guide` with the tokenizer's call tags (:mod:`common.tools.tags`), replacing or
   wrapping the request's ``response_format``; it is compiled before any stage like any guide, so parameters that
   cannot be served are refused there.
3. **prefill, decode** — nothing of their own: the definitions travel with the messages for prefill to render the same
   prompt; the guide constrains the tokens as any other.
4. **ingress, answer** — :class:`~common.tools.calls.CallReader` reads the detokenized answer (streamed or whole) into
   ``content`` and ``tool_calls`` deltas; ``finish_reason`` becomes ``tool_calls`` when it stopped after a call.
"""
