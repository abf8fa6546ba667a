"""OpenAI chat-completions request schema (the subset Prism serves) and its translation to Prism's own types.

Validation here is the first, cheapest layer: malformed JSON shapes, unknown content-part types, ``n != 1`` and bad
sampling values are 400s before any stage is touched. Unknown top-level fields that OpenAI clients commonly send
(``user``, ``metadata`` …) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.errors import InvalidRequestError
from common.media.loader import MediaRef
from common.protocol.sampling import SamplingParams


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = True


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    return_token_ids: bool = False
    """Prism extension: include ``prompt_token_ids`` and each choice's ``token_ids``."""

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop or (),
        )

    def media_refs(self) -> list[MediaRef]:
        refs = []
        for msg in self.messages:
            if isinstance(msg.content, str):
                continue
            for part in msg.content:
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
            if isinstance(msg.content, str):
                out.append({"role": msg.role, "content": msg.content})
                continue
            parts: list[dict[str, Any]] = []
            for part in msg.content:
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                else:
                    parts.append({"type": "image" if isinstance(part, ImagePart) else "video"})
            out.append({"role": msg.role, "content": parts})
        return out


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a request body; pydantic errors become one 400 naming the first bad field."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequestError(f"invalid request: {where}: {first['msg']}", param=where or None) from None
