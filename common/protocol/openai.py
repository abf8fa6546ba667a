"""OpenAI chat-completions request schema (the subset Prism serves) and its translation to Prism's own types.

Validation here comes right after the raw-body checks of :mod:`common.protocol.body` (size, depth, counts,
unsupported parameters), and before any stage is touched: malformed shapes, unknown content-part types, bad sampling
values and stop strings are 400s naming the parameter. Unknown top-level fields (``user``, ``metadata``, vendor
extensions) are tolerated; their names are kept for the request log (:attr:`ChatCompletionRequest.ignored_fields`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from common.config import ServerConfig
from common.errors import InvalidRequestError
from common.grammar.formats import guide_from_request
from common.grammar.guide import Guide
from common.protocol.body import check_parameters, check_shape
from common.protocol.handoff import MediaRef
from common.protocol.sampling import MAX_TOP_LOGPROBS, SamplingParams, check_choices, stop_problem
from common.tools.spec import ToolRequest, tools_from_request


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageURL(_Part):
    url: str
    detail: str | None = None


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Part):
    url: str
    fps: float | None = Field(default=None, gt=0)
    """Frames per second to sample (lowered to the server cap if higher)."""
    max_frames: int | None = Field(default=None, ge=1)
    """Frames to sample at most (lowered to the server cap if higher)."""


class VideoPart(_Part):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = TextPart | ImagePart | VideoPart


class FunctionCall(_Part):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    arguments: str
    """The call's arguments as JSON text (an object), as OpenAI returns them; ``""`` (some clients send it for a
    function without parameters) is ``{}``."""

    _parsed: tuple[dict[str, Any] | None] | None = PrivateAttr(default=None)
    """``(parsed(),)`` once parsed."""

    def parsed(self) -> dict[str, Any] | None:
        """The arguments as an object (``None``: not a JSON object, or nested past what the parser takes); parsed once
        (the request's check, then its template, read the same object)."""
        if self._parsed is None:
            self._parsed = (_object(self.arguments),)
        return self._parsed[0]


def _object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class ToolCallIn(_Part):
    """A call the assistant made earlier in the conversation."""

    id: str | None = Field(default=None, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    """``None`` only for an assistant turn that calls tools."""
    tool_calls: list[ToolCallIn] | None = None
    """An assistant turn's calls (rendered by the chat template as the model writes them)."""
    tool_call_id: str | None = Field(default=None, max_length=128)
    """A tool message's answer is to this call (OpenAI requires it; the templates do not show it)."""

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        if self.role == "tool" and not isinstance(self.content, str):
            if any(not isinstance(p, TextPart) for p in self.content or ()):
                raise ValueError("a tool message's content is text")
        for call in self.tool_calls or ():
            if call.function.parsed() is None:
                raise ValueError("tool_calls' function.arguments must be a JSON object as text")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    """Send a usage chunk (no choices) before ``[DONE]``; OpenAI sends one only when asked."""


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    """Return each generated token's log-probability (``choices[].logprobs.content``); ``null`` is false."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """With ``logprobs``: this many most likely alternatives per token (0–20)."""
    n: int | None = Field(default=None, ge=1, strict=True)
    """Choices per request (``null``: 1), up to ``server.max_n``: one prefill, ``n`` decodes sharing the prompt's KV;
    choice ``i`` samples with seed ``seed + i``."""
    return_token_ids: bool = False
    """Prism extension: include ``prompt_token_ids`` and each choice's ``token_ids``."""
    ignore_eos: bool = False
    """Extension (vLLM's name): generate past the model's end-of-sequence tokens, until ``max_tokens`` or a stop
    string (benchmarks and tests that need a stream of a known length)."""
    response_format: dict[str, Any] | None = None
    """Structured output (``json_object``, ``json_schema``): read by :mod:`common.grammar.formats`, with vLLM's
    ``structured_outputs`` / ``guided_json`` / ``guided_regex`` / ``guided_choice`` below."""
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    """Functions the model may call (:mod:`common.tools.spec` reads them, with ``tool_choice`` and
    ``parallel_tool_calls``)."""
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    priority: Literal["interactive", "batch"] | None = None
    """Prism extension: the traffic class (also ``X-Prism-Priority``); batch work ranks behind interactive work in
    every stage's queue."""
    _ignored: list[str] = PrivateAttr(default_factory=list)
    _guide: Guide | None = PrivateAttr(default=None)
    _tools: ToolRequest | None = PrivateAttr(default=None)

    @property
    def tool_request(self) -> ToolRequest | None:
        """The functions offered and ``tool_choice`` (``None``: no tools); the ingress's plan turns them into the
        output's guide, with the model's call tags."""
        return self._tools

    @property
    def guide(self) -> Guide | None:
        """The output constraint the request asks for (shape- and size-checked; compiled by the ingress's plan)."""
        return self._guide

    @property
    def ignored_fields(self) -> list[str]:
        """Names of the unknown top-level fields the client sent (tolerated, logged by name)."""
        return self._ignored

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop or (),
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            guide=self._guide,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            n=self.n or 1,
            ignore_eos=self.ignore_eos,
        )

    def media_refs(self) -> list[MediaRef]:
        refs = []
        for msg in self.messages:
            if isinstance(msg.content, str):
                continue
            for part in msg.content or ():  # (None: an assistant turn that only called tools)
                if isinstance(part, ImagePart):
                    refs.append(MediaRef(kind="image", url=part.image_url.url))
                elif isinstance(part, VideoPart):
                    v = part.video_url
                    refs.append(MediaRef(kind="video", url=v.url, fps=v.fps, max_frames=v.max_frames))
        return refs

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages for the chat template: media parts become bare ``{"type": "image"|"video"}`` markers, so no URL
        (or data-URL payload) ever reaches the template or the logs."""
        out = []
        for msg in self.messages:
            entry: dict[str, Any] = {"role": msg.role}
            if msg.content is None or isinstance(msg.content, str):
                entry["content"] = msg.content or ""
            else:
                parts: list[dict[str, Any]] = []
                for part in msg.content:
                    if isinstance(part, TextPart):
                        parts.append({"type": "text", "text": part.text})
                    else:
                        parts.append({"type": "image" if isinstance(part, ImagePart) else "video"})
                entry["content"] = parts
            if msg.tool_calls:  # arguments as an object, as Hugging Face chat templates take them (checked as one)
                entry["tool_calls"] = [
                    {"type": "function", "function": {"name": c.function.name, "arguments": c.function.parsed()}}
                    for c in msg.tool_calls
                ]
            out.append(entry)
        return out


def parse_chat_request(body: Any, server: ServerConfig | None = None) -> ChatCompletionRequest:
    """Validate a decoded request body under ``server``'s limits (the defaults when ``None``): counts and unsupported
    parameters on the raw dict first, then the schema (pydantic errors become one 400 naming the first bad field),
    then the stop strings."""
    server = server or ServerConfig()
    check_shape(body, server.max_messages, server.max_content_parts, server.max_text_chars)
    ignored = check_parameters(body, frozenset(ChatCompletionRequest.model_fields), server.max_unknown_fields)
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        # A union field reports one error per alternative; the deepest is the one that says what is wrong.
        worst = max(exc.errors(), key=lambda e: len(e["loc"]))
        where = ".".join(str(p) for p in worst["loc"] if not _type_tag(p))
        raise InvalidRequestError(f"invalid request: {where}: {worst['msg']}", param=where or None) from None
    _check_stop(req.stop)
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    check_choices(req.n or 1, server.max_n)
    req._ignored = ignored
    req._guide = guide_from_request(body, server.max_response_format_bytes)
    req._tools = tools_from_request(body, server.max_tools_bytes)
    return req


def _type_tag(segment: object) -> bool:
    """A location segment pydantic adds for a union alternative (``str``, ``list[str]``, ``TextPart``), not a field."""
    if not isinstance(segment, str):
        return False
    return "[" in segment or segment in ("str", "int", "float", "bool") or segment[:1].isupper()


def _check_stop(stop: str | list[str] | None) -> None:
    problem = stop_problem([stop] if isinstance(stop, str) else stop or [])
    if problem:
        raise InvalidRequestError(problem, code="invalid_stop", param="stop")
