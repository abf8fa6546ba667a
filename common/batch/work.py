"""What the batch job does to its rows, on the same stage code as online serving — one class per Ray Data stage.

Rows are plain dicts (Ray Data's rows); arrays stay numpy, so between stages they travel through Ray's object store
as Arrow tensor columns, never as Python lists of pixels. A row that fails anywhere becomes ``status="error"`` with
the typed error's code and message and passes through the later stages untouched: one bad clip never stops the job.

* :class:`ClipLoader` (CPU task): fetch (SSRF-safe fetcher, ``file://`` under the media root), header checks and
  duration cap, frame sampling (server policy, row's ``fps`` / ``max_frames`` may only lower it), the processor.
* :class:`ClipEncoder` (actor): vision tower + projector over a batch of clips.
* :class:`ClipGenerator` (actor): chat template + span validation + chunked prefill per clip, then continuous-batching
  decode of the whole batch over a paged KV pool — greedy unless the row sets ``temperature`` (with its ``seed``), so
  a row's text is what the online API answers with the same sampling for the same clip and prompt. A row of ``n``
  choices is one prefill and ``n`` sequences sharing its KV; ``text`` / ``logprobs`` are choice 0's, ``choices`` every
  choice's (JSON), ``output_tokens`` all of theirs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from common.config import PrismConfig
from common.engine.decode import DecodeEngine
from common.engine.prefill import PrefillEngine
from common.engine.sequence import TokenEvent
from common.errors import InvalidRequestError, PrismError
from common.grammar.compiler import compiler_for
from common.grammar.formats import guide_from_request
from common.grammar.guide import Guide
from common.kv.pool import KVPool
from common.media.loader import LoadTimings
from common.media.stage import MediaStage
from common.model.loader import load_frontend, load_model
from common.protocol.handoff import MediaRef, ProcessedMedia, VisualEmbeddings
from common.protocol.sampling import SamplingParams, check_choices
from common.stages.encode import encode_media
from common.stages.logprobs import entries
from common.stages.merge import merge
from common.stages.process import process_loaded
from common.stages.prompt import build_prompt
from common.stages.stops import visible_text

Row = dict[str, Any]
_EMPTY = np.zeros((0, 0), np.float32)

# Every row carries every column of its stage, with these defaults, so Ray Data blocks always share one schema (an
# error row has empty arrays and zeros, never missing columns or nulls). 0 stands for "unset" in the optional
# manifest numbers inside the pipeline.
LOADED: dict[str, Any] = {
    "status": "ok",
    "error_code": "",
    "error_message": "",
    "frames": 0,
    "visual_tokens": 0,
    "pixel_values": _EMPTY,
    "grid_thw": np.zeros(3, np.int64),
    "media_digest": "",
    "source_w": 0,
    "source_h": 0,
    "seconds_fetch_decode": 0.0,
    "seconds_process": 0.0,
}
ENCODED: dict[str, Any] = {"embeddings": _EMPTY, "encoder_revision": "", "seconds_encode": 0.0}
GENERATED: dict[str, Any] = {
    "text": "",
    "logprobs": "",
    "choices": "",
    "prompt_tokens": 0,
    "output_tokens": 0,
    "seconds_prefill": 0.0,
    "seconds_decode": 0.0,
}


def fail(row: Row, exc: BaseException) -> Row:
    """The row as an error: typed errors keep their code; anything else is ``internal_error`` (no stack, no data)."""
    if isinstance(exc, PrismError):
        code, message = exc.code, exc.message
    else:
        code, message = "internal_error", f"{type(exc).__name__}: {exc}"[:500]
    return row | {"status": "error", "error_code": code, "error_message": message, "pixel_values": _EMPTY}


def input_row(row: Row) -> Row:
    """A manifest row for the pipeline: optional numbers as 0 when unset."""
    return (
        {k: row.get(k) or 0 for k in ("max_tokens", "fps", "max_frames")}
        | {k: row[k] for k in ("id", "video", "prompt")}
        | {"response_format": row.get("response_format") or ""}
        | {"top_logprobs": -1 if row.get("logprobs") is None else int(row["logprobs"])}  # (-1: none asked)
        | {"n": int(row.get("n") or 1), "temperature": float(row.get("temperature") or 0.0)}
        | {"seed": -1 if row.get("seed") is None else int(row["seed"])}  # (-1: a random one)
    )


def row_guide(cfg: PrismConfig, model: Any, row: Row) -> Guide | None:
    """The row's output constraint, compiled for ``model``'s tokenizer (400 ``invalid_response_format`` otherwise)."""
    if not row.get("response_format"):  # (its JSON text, checked as a JSON object by the manifest)
        return None
    guide = guide_from_request(
        {"response_format": json.loads(row["response_format"])}, cfg.server.max_response_format_bytes
    )
    if guide is not None:
        compiler_for(model).check(guide)
    return guide


def _ok(row: Row) -> bool:
    return row.get("status") == "ok"


class ClipLoader:
    def __init__(self, cfg: PrismConfig) -> None:
        self.cfg = cfg
        self.frontend = load_frontend(cfg.model)
        self.stage = MediaStage(cfg.media)
        if "video" not in self.frontend.adapter.modalities:
            raise ValueError(f"model {self.frontend.served_name} does not accept video; use a video-capable model")

    def __call__(self, row: Row) -> Row:
        row = row | LOADED
        try:
            row_guide(self.cfg, self.frontend, row)  # (a constraint that cannot be served costs no fetch)
            ref = MediaRef("video", row["video"], fps=row.get("fps") or None, max_frames=row.get("max_frames") or None)
            timings = LoadTimings()
            loaded = self.stage.load([ref], timings)
            start = time.perf_counter()
            (media,) = process_loaded(self.frontend, loaded, options=self.stage.decode_options())
        except Exception as exc:  # every failure is this row's, never the job's
            return fail(row, exc)
        return row | {
            "frames": len(loaded[0].frames),
            "visual_tokens": media.num_visual_tokens,
            "pixel_values": np.ascontiguousarray(media.pixel_values, dtype=np.float32),
            "grid_thw": np.asarray(media.grid_thw, np.int64),
            "media_digest": media.media_digest,
            "source_w": media.source_size[0],
            "source_h": media.source_size[1],
            "seconds_fetch_decode": timings.fetch_s + timings.decode_s,
            "seconds_process": time.perf_counter() - start,
        }


def _processed(row: Row) -> ProcessedMedia:
    return ProcessedMedia(
        media_index=0,
        modality="video",
        media_digest=str(row["media_digest"]),
        pixel_values=np.asarray(row["pixel_values"], np.float32),
        grid_thw=tuple(int(x) for x in row["grid_thw"]),  # type: ignore[arg-type]
        num_visual_tokens=int(row["visual_tokens"]),
        source_size=(int(row["source_w"]), int(row["source_h"])),
    )


class ClipEncoder:
    def __init__(self, cfg: PrismConfig) -> None:
        self.lm = load_model(cfg.model)

    def __call__(self, rows: Sequence[Row]) -> list[Row]:
        out = [r | ENCODED for r in rows]
        todo = [i for i, r in enumerate(out) if _ok(r)]
        if not todo:
            return out
        try:
            embeddings = self._encode([out[i] for i in todo])
        except Exception:  # isolate the clip that broke the batch: encode one by one
            embeddings = []
            for i in todo:
                try:
                    embeddings.extend(self._encode([out[i]]))
                except Exception as exc:
                    out[i] = fail(out[i], exc)
                    embeddings.append(None)
        for i, emb in zip(todo, embeddings, strict=True):
            if emb is not None:
                out[i] = out[i] | {"embeddings": emb[0], "encoder_revision": emb[1], "seconds_encode": emb[2]}
                out[i]["pixel_values"] = _EMPTY  # the pixels are not needed past here
        return out

    def _encode(self, rows: Sequence[Row]) -> list[tuple[np.ndarray, str, float]]:
        start = time.perf_counter()
        items = [_processed(r) for r in rows]
        result = encode_media(self.lm, items)
        elapsed = time.perf_counter() - start
        total = sum(int(r["visual_tokens"]) for r in rows) or 1
        return [
            (e.embeddings, e.encoder_revision, elapsed * int(r["visual_tokens"]) / total)
            for e, r in zip(result, rows, strict=True)
        ]


class ClipGenerator:
    def __init__(self, cfg: PrismConfig) -> None:
        self.cfg = cfg
        self.lm = load_model(cfg.model)
        eng = cfg.engine
        self.prefill = PrefillEngine(self.lm, block_size=eng.kv_block_size, chunk_tokens=eng.prefill_chunk_tokens)
        pool = KVPool(eng.kv_pool_blocks, eng.kv_block_size, self.lm.kv_shape, self.lm.dtype, eng.max_lease_fraction)
        self.decode = DecodeEngine(self.lm, pool, max_batch=eng.max_batch)

    def sampling(self, row: Row) -> SamplingParams:
        max_tokens = int(row.get("max_tokens") or self.cfg.batch.default_max_tokens)
        if max_tokens > self.cfg.engine.max_output_tokens:
            raise InvalidRequestError(
                f"max_tokens is {max_tokens}; the limit is {self.cfg.engine.max_output_tokens}", param="max_tokens"
            )
        n = int(row.get("n") or 1)
        check_choices(n, self.cfg.server.max_n)
        guide = row_guide(self.cfg, self.lm, row)
        top, seed = int(row.get("top_logprobs", -1)), int(row.get("seed", -1))
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(row.get("temperature") or 0.0),
            seed=seed if seed >= 0 else None,
            guide=guide,
            logprobs=top if top >= 0 else None,
            n=n,
        ).resolved()

    def __call__(self, rows: Sequence[Row]) -> list[Row]:
        """The rows with their text, reduced to the output columns (the arrays are dropped here)."""
        out = [r | GENERATED for r in rows]
        started: dict[str, tuple[int, SamplingParams, int]] = {}
        for i, row in enumerate(out):
            if not _ok(row):
                continue
            try:
                sampling, pre, seconds = self._prefill(row)
                self.decode.submit(row["id"], pre, sampling)
            except Exception as exc:
                out[i] = fail(row, exc)
                continue
            out[i] = row | {"prompt_tokens": len(pre.prompt_token_ids), "seconds_prefill": seconds}
            started[row["id"]] = (i, sampling, len(pre.prompt_token_ids))
        decoded = self._decode({rid: sampling.n for rid, (_, sampling, _) in started.items()})
        total = max(1, sum(len(ids) for choices in decoded.tokens.values() for ids in choices))
        for rid, (i, sampling, _) in started.items():
            failed = decoded.failed(rid)
            if failed:
                out[i] = fail(out[i], PrismError(f"decode ended with {failed}"))
                continue
            choices = [self._choice(decoded, rid, c, sampling) for c in range(sampling.n)]
            spent = sum(len(ids) for ids in decoded.tokens[rid])
            out[i] = out[i] | {"text": choices[0]["text"], "output_tokens": spent}
            out[i] |= {"seconds_decode": decoded.seconds * spent / total, "choices": _compact(choices)}
            if sampling.logprobs is not None:  # (JSON text: the online API's logprobs.content entries)
                out[i]["logprobs"] = _compact(choices[0]["logprobs"])
        return [{k: v for k, v in r.items() if k not in ARRAYS} for r in out]

    def _choice(self, decoded: _Decoded, rid: str, index: int, sampling: SamplingParams) -> dict[str, Any]:
        """Choice ``index`` of a row as its ``choices`` entry."""
        ids = decoded.tokens[rid][index]
        choice = {"index": index, "text": visible_text(self.lm.tokenizer, ids, sampling)}
        choice["finish_reason"] = decoded.finish[rid][index]
        if sampling.logprobs is not None:
            choice["logprobs"] = entries(self.lm.token_bytes, ids, decoded.logprobs[rid][index])
        return choice

    def _prefill(self, row: Row):
        start = time.perf_counter()
        sampling = self.sampling(row)
        emb = VisualEmbeddings(
            media_index=0,
            modality="video",
            media_digest=str(row["media_digest"]),
            embeddings=np.asarray(row["embeddings"], np.float32),
            grid_thw=tuple(int(x) for x in row["grid_thw"]),  # type: ignore[arg-type]
            encoder_revision=str(row["encoder_revision"]),
        )
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": row["prompt"]}]}]
        prompt = build_prompt(self.lm, messages, [emb], self.cfg.engine.max_prompt_tokens)
        try:
            result = self.prefill.run(row["id"], merge(self.lm, prompt, [emb]), sampling)
        finally:
            self.prefill.cancel(row["id"])  # no-op once finished; drops it if a chunk failed
        return sampling, result.output, time.perf_counter() - start

    def _decode(self, running: dict[str, int]) -> _Decoded:
        """Step the engine until every choice of the ``running`` rows (id → its ``n``) finished."""
        start = time.perf_counter()
        out = _Decoded(running)
        try:
            while not out.done:
                for event in self.decode.step():
                    out.add(event)
                if not self.decode.has_work() and self.decode.num_waiting == 0 and not out.done:
                    break  # nothing left that could finish them (cannot happen with a sane pool)
        finally:
            for rid in out.unfinished():
                self.decode.cancel(rid)
        out.seconds = time.perf_counter() - start
        return out


class _Decoded:
    """The decode engine's events for a batch's rows, per row and choice."""

    def __init__(self, running: dict[str, int]) -> None:
        self.tokens: dict[str, list[list[int]]] = {rid: [[] for _ in range(n)] for rid, n in running.items()}
        self.logprobs: dict[str, list[list]] = {rid: [[] for _ in range(n)] for rid, n in running.items()}
        self.finish: dict[str, list[str | None]] = {rid: [None] * n for rid, n in running.items()}
        self.aborted: dict[str, str] = {}
        self.seconds = 0.0

    def add(self, event: TokenEvent) -> None:
        rid = event.request_id
        if event.token_id is None:  # (an abort ends every choice of the row)
            self.aborted[rid] = event.finish_reason or "error"
            return
        self.tokens[rid][event.index].append(event.token_id)
        self.logprobs[rid][event.index].append(event.logprob)
        if event.finish_reason is not None:
            self.finish[rid][event.index] = event.finish_reason

    def unfinished(self) -> list[str]:
        return [rid for rid, ends in self.finish.items() if rid not in self.aborted and None in ends]

    @property
    def done(self) -> bool:
        return not self.unfinished()

    def failed(self, rid: str) -> str | None:
        """Why the row has no answer (``None``: every choice finished)."""
        return self.aborted.get(rid) or ("no result" if None in self.finish[rid] else None)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


ARRAYS = ("pixel_values", "embeddings", "grid_thw")
