"""The tool-call format of the embedded models' chat templates: Jinja fragments both families compose.

The format is the one Qwen2.5's checkpoints are trained on (Hermes-style): the function definitions go into the
system turn as one JSON object per line between ``<tools>`` and ``</tools>``; the model answers a call as

```
<tool_call>
{"name":"get_weather","arguments":{"city":"Oslo"}}
</tool_call>
```

(several calls one per line, each in its own tags); a tool's answer comes back in a user turn as
``<tool_response>\\n…\\n</tool_response>`` (consecutive tool messages share one turn). ``<tool_call>`` and
``</tool_call>`` (:data:`common.tools.tags.TOOL_MARKERS`) are single tokens of the built tokenizers, added as plain —
not special — tokens as Qwen2.5 has them, so they stay in decoded text and the grammar of :mod:`common.tools.grammar`
can switch on them. The fragments expect the message shapes that
:meth:`common.protocol.openai.ChatCompletionRequest.template_messages` writes: an assistant message's ``tool_calls``
with ``function.arguments`` an object (as Hugging Face chat templates take it; written as compact JSON, the way the
model writes it) and ``content`` a string (empty when the turn only calls).

The instruction prose is ours; the tags, the JSON shape and where they sit are the real family's, so a real
checkpoint trained on them reads the same prompt.
"""

from __future__ import annotations


def _lit(text: str) -> str:
    """A Jinja string literal of ``text`` (escaped for a single-quoted Jinja string inside a Python string)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


TOOLS_INTRO = (
    "\n\n# Tools\n\nYou can call functions to help answer the user. Their signatures, one JSON object per line, are "
    "between the <tools> and </tools> tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nTo call a function, answer with a JSON object holding its name and its arguments between "
    '<tool_call> and </tool_call> tags, one call per tag pair:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)

TOOLS_BLOCK = (
    "{{- " + _lit(TOOLS_INTRO) + " -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- " + _lit(TOOLS_OUTRO) + " -}}"
)
"""The tool definitions and how to call them (appended to the system turn's text)."""

ASSISTANT_CALLS = (
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if not loop.first or message['content'] -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\":' + (call['function']['name'] | tojson) + ',\"arguments\":' -}}"
    "{{- (call['function']['arguments'] | tojson(separators=(',', ':'))) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}{%- endif -%}"
)
"""An assistant turn's calls, after its text, exactly as the model writes them."""

TOOL_RESPONSE = (
    "{{- '\\n<tool_response>\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}{{- part['text'] -}}{%- endfor -%}{%- endif -%}"
    "{{- '\\n</tool_response>' -}}"
)
"""One tool message's answer (its text parts joined), inside the user turn that carries it."""
