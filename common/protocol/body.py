"""The first checks on a chat request body, in the order its cost appears — before the schema, the tokenizer or any
stage sees it.

1. bytes: the caller reads at most ``max_body_bytes`` (the proxy refused larger bodies already);
2. JSON: :func:`decode_json` first counts the body's structural characters (``{ [ , :``) on its bytes — one C-speed
   pass each — and refuses a body wider than ``max_json_structure`` before ``json.loads`` builds its objects (a
   21 MB ``[{},{},…]`` is 212 MB of Python objects built while the GIL is held: every stream of the replica would
   stall); then it parses, refuses nesting deeper than ``max_json_depth`` (a 5,000-deep body would otherwise reach the
   schema validator's recursion) and strings that are not Unicode (a lone surrogate such as ``"\ud800"`` is valid JSON
   but cannot be encoded: it would fail deep in the tokenizer or a URL);
3. shape: :func:`check_shape` counts messages, content parts (and an assistant turn's tool calls) and text characters
   (their arguments too) on the raw dict, so a body of a million tiny messages is refused before pydantic builds a
   million objects;
4. parameters: OpenAI parameters Prism does not implement are refused by name when they carry anything but their
   default (clients routinely send ``n: 1`` or ``functions: []``); unknown fields are tolerated (vendor
   extensions) up to ``max_unknown_fields`` and returned by name for the request log.

Each refusal is a 4xx naming the limit and the parameter; none echoes the client's values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from common.errors import InvalidRequestError, UnsupportedParameter

MAX_LOGGED_FIELDS = 16
"""Unknown field names listed in the request log, at most; only identifier-like names (``[A-Za-z0-9_.-]{1,64}``)
are listed, the rest counted."""
_FIELD_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _default_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == a for a in allowed)


UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    # parameter → "this value is what not implementing it gives anyway"
    "functions": _default_or([]),
    "function_call": _default_or("none"),
    "logit_bias": _default_or({}),
    "best_of": _default_or(1),
    "audio": _default_or(),
    "modalities": _default_or(["text"]),
    "prediction": _default_or(),
}
"""OpenAI chat parameters Prism does not implement, with the values it honours by not implementing them."""


def ascii_int(text: str, max_digits: int = 15) -> int | None:
    """A header's non-negative integer (``Content-Length``, ``X-Prism-Deadline-Ms``), or ``None``: ASCII digits only
    (``str.isdigit`` also accepts "²", which ``int`` refuses) and at most ``max_digits`` of them."""
    text = text.strip()
    if not (0 < len(text) <= max_digits and text.isascii() and text.isdigit()):
        return None
    return int(text)


STRUCTURAL = (b"{", b"[", b",", b":")


def decode_json(raw: bytes | bytearray, max_depth: int, max_structure: int | None = None) -> Any:
    """Parse a body; 400 ``json_too_wide`` past ``max_structure`` structural characters (counted before parsing),
    ``invalid_json`` if it is not JSON or holds a string that is not Unicode, ``json_too_deep`` past ``max_depth``
    levels."""
    if max_structure is not None:
        count = 0
        for char in STRUCTURAL:
            count += raw.count(char)
            if count > max_structure:
                raise InvalidRequestError(
                    f"request JSON has more than {max_structure} structural characters ({{ [ , :), the limit",
                    code="json_too_wide",
                )
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidRequestError(
            f"request JSON is nested deeper than {max_depth} levels", code="json_too_deep"
        ) from None
    except ValueError:
        raise InvalidRequestError("request body is not valid JSON", code="invalid_json") from None
    _check_tree(body, max_depth)
    return body


def _check_tree(body: Any, max_depth: int) -> None:
    """Nesting depth and Unicode of every string, keys included, in one walk over the parsed body."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_unicode(node)
        elif isinstance(node, (dict, list)):
            if depth > max_depth:
                raise InvalidRequestError(
                    f"request JSON is nested deeper than {max_depth} levels", code="json_too_deep"
                )
            if isinstance(node, dict):
                for key in node:
                    _check_unicode(key)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, str)))


def _check_unicode(text: str) -> None:
    """Refuse a string with a lone surrogate (``\\ud800``…): JSON's grammar allows the escape, Unicode does not."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(
                "request JSON holds a string that is not valid Unicode (a lone surrogate escape)", code="invalid_json"
            ) from None


def check_shape(body: Any, max_messages: int, max_parts: int, max_text_chars: int) -> None:
    """Counts on the raw body (types are the schema's to refuse): messages, parts per message, text characters."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", code="invalid_json")
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > max_messages:
        raise InvalidRequestError(
            f"request has {len(messages)} messages; the limit is {max_messages}",
            code="too_many_messages",
            param="messages",
        )
    chars = 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            if len(content) > max_parts:
                raise InvalidRequestError(
                    f"message {i} has {len(content)} content parts; the limit is {max_parts}",
                    code="too_many_content_parts",
                    param=f"messages.{i}.content",
                )
            chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):  # an assistant turn's calls are prompt text too
            if len(calls) > max_parts:
                raise InvalidRequestError(
                    f"message {i} has {len(calls)} tool calls; the limit is {max_parts}",
                    code="too_many_content_parts",
                    param=f"messages.{i}.tool_calls",
                )
            chars += sum(_call_chars(c) for c in calls)
        if chars > max_text_chars:
            raise InvalidRequestError(
                f"request text is over {max_text_chars} characters, the limit",
                code="text_too_long",
                param="messages",
            )


def _call_chars(call: Any) -> int:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return 0
    return sum(len(v) for v in (function.get("name"), function.get("arguments")) if isinstance(v, str))


def check_parameters(body: dict[str, Any], known: frozenset[str], max_unknown: int | None = None) -> list[str]:
    """Refuse unsupported parameters set to anything but their default, and more than ``max_unknown`` unknown fields;
    returns the unknown fields' names (for the request log: names only, never values)."""
    for name, harmless in UNSUPPORTED.items():
        if name in body and not harmless(body[name]):
            raise UnsupportedParameter(f"parameter {name!r} is not supported by this server", param=name)
    unknown = sorted(k for k in body if k not in known and k not in UNSUPPORTED)
    if max_unknown is not None and len(unknown) > max_unknown:
        raise InvalidRequestError(
            f"request has {len(unknown)} fields this server does not know; the limit is {max_unknown}",
            code="too_many_fields",
        )
    names = [k for k in unknown if _FIELD_NAME.fullmatch(k)][:MAX_LOGGED_FIELDS]
    others = len(unknown) - len(names)  # names that are not plain identifiers could carry content: counted only
    return names + ([f"+{others} more"] if others else [])
