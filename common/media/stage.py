"""The media stage engine that a Media deployment (or an offline batch task) holds for its lifetime.

Start-up refuses to run if Pillow's own guards were switched off in this process (defence in depth: Prism checks
pixels itself, but a disabled guard means someone changed global decoder state). Each call then runs the two-layer
checks, fetch and decode of :mod:`common.media.loader` under the configured policy — in one go (:meth:`MediaStage.load`)
or in two phases with admission in between (:meth:`MediaStage.fetch`, then :meth:`MediaStage.decode`).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.config.media import MediaConfig
from common.media.fetch import MediaFetcher, Resolver, TimedResolver
from common.media.image import check_pillow_guard
from common.media.loader import CheckedMedia, LoadedMedia, LoadTimings, decode_media, fetch_media, load_media
from common.protocol.handoff import MediaRef
from common.stop import NEVER, Stop


class MediaStage:
    def __init__(self, cfg: MediaConfig, resolver: Resolver | None = None) -> None:
        """``resolver``: the system's, with ``media.dns_timeout_s`` (:class:`TimedResolver`), unless given."""
        check_pillow_guard()
        self.cfg = cfg
        self.fetcher = MediaFetcher(cfg, resolver=resolver or TimedResolver(cfg.dns_timeout_s))

    def load(self, refs: Sequence[MediaRef], timings: LoadTimings | None = None) -> list[LoadedMedia]:
        return load_media(refs, self.cfg, self.fetcher, timings)

    def fetch(self, refs: Sequence[MediaRef], timings: LoadTimings, stop: Stop = NEVER) -> list[CheckedMedia]:
        """Fetched and header-checked; nothing decoded yet."""
        return fetch_media(refs, self.cfg, self.fetcher, timings, stop)

    def decode(self, checked: Sequence[CheckedMedia], timings: LoadTimings, stop: Stop = NEVER) -> list[LoadedMedia]:
        return decode_media(checked, self.cfg, timings, stop)

    def decode_options(self) -> dict[str, object]:
        return decode_options(self.cfg)


def decode_options(cfg: MediaConfig) -> dict[str, object]:
    """Decode settings that shape pixels before the processor: part of every processor/encoder cache key."""
    return {"background_rgb": list(cfg.background_rgb), "exif_transpose": True}
