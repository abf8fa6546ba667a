"""KV exported by prefill crosses an OS process boundary as numpy (wire bytes, no pickle) and decodes to the same
tokens; blocks round-trip exactly for fp32 and bf16; inconsistent hand-offs are refused with typed errors."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from common.errors import HandoffError, RevisionMismatch
from common.kv.blocks import export_kv, import_kv, seal, verify_handoff
from common.protocol.handoff import PrefillOutput
from common.protocol.sampling import SamplingParams
from common.protocol.wire import from_bytes, to_bytes
from common.reference.decode import decode
from tests.unit.common.kv.kv_decode_worker import fixed_request

WORKER = Path(__file__).with_name("kv_decode_worker.py")


def _prefill(lm, n_images: int, sampling: SamplingParams) -> PrefillOutput:
    return fixed_request(lm, n_images, sampling)


@pytest.mark.parametrize(
    "sampling", [SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=5)]
)
def test_decode_in_another_process_gives_same_tokens(tiny_model, model_cache, tmp_path, sampling):
    lm = tiny_model
    pre = _prefill(lm, 2, sampling)
    local = decode(lm, pre, sampling)
    path = tmp_path / "prefill.npz"
    path.write_bytes(to_bytes(pre))
    proc = subprocess.run(
        [sys.executable, str(WORKER), "decode", lm.served_name, model_cache, str(path), sampling.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    remote = json.loads(proc.stdout.strip().splitlines()[-1])
    assert remote["token_ids"] == list(local.token_ids)
    assert remote["text"] == local.text


def test_prefill_output_is_numpy_only(tiny_qwen):
    pre = _prefill(tiny_qwen, 1, SamplingParams(max_tokens=4))
    assert isinstance(pre.kv.keys, np.ndarray) and isinstance(pre.prompt_token_ids, np.ndarray)
    assert pre.rope_delta != 0, "Qwen2-VL with an image must carry a non-zero M-RoPE delta to decode"
    assert pre.kv.num_blocks == -(-len(pre.prompt_token_ids) // 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tokens,block", [(1, 16), (16, 16), (37, 16), (37, 5)])
def test_blocks_round_trip_exactly(dtype, n_tokens, block):
    g = torch.Generator().manual_seed(0)
    layers, heads, dim = 3, 2, 8
    cache = DynamicCache()
    originals = []
    for i in range(layers):
        k = torch.randn(1, heads, n_tokens, dim, generator=g).to(dtype)
        v = torch.randn(1, heads, n_tokens, dim, generator=g).to(dtype)
        cache.update(k, v, i)
        originals.append((k, v))
    kv = export_kv(cache, block)
    assert kv.keys.shape == (layers, -(-n_tokens // block), block, heads, dim)  # the decode pool's own layout
    kv = from_bytes(type(kv), to_bytes(kv))  # through the wire, too
    back = import_kv(kv, None, (layers, heads, dim), dtype)
    for i, (k, v) in enumerate(originals):
        assert torch.equal(back.layers[i].keys, k) and torch.equal(back.layers[i].values, v)


def test_inconsistent_handoffs_are_refused(tiny_llava):
    lm = tiny_llava
    sampling = SamplingParams(max_tokens=4)
    pre = _prefill(lm, 1, sampling)
    with pytest.raises(RevisionMismatch, match="model revision"):  # (a HandoffLost: the ingress issues it again)
        decode(lm, replace(pre, model_revision="someone-else"), sampling)
    with pytest.raises(HandoffError, match="tokens"):
        decode(lm, replace(pre, prompt_token_ids=pre.prompt_token_ids[:-1]), sampling)
    with pytest.raises(HandoffError, match="shape"):
        decode(lm, replace(pre, kv=replace(pre.kv, keys=pre.kv.keys[:, :-1])), sampling)
    with pytest.raises(HandoffError, match="dtype"):
        decode(lm, replace(pre, kv=replace(pre.kv, dtype="bfloat16")), sampling)
    with pytest.raises(HandoffError, match="do not match the keys"):
        decode(lm, replace(pre, kv=replace(pre.kv, values=pre.kv.values.astype(np.float64))), sampling)
    wide = replace(pre.kv, keys=pre.kv.keys.astype(np.float64), values=pre.kv.values.astype(np.float64))
    with pytest.raises(HandoffError, match="numpy dtype"):
        decode(lm, replace(pre, kv=wide), sampling)


def test_a_sealed_handoff_is_bound_to_its_attempt_and_its_bytes(tiny_llava):
    """Decode refuses a payload of another request or attempt, or whose bytes changed with its shape intact; the seal
    survives the wire encoding."""
    pre = seal(_prefill(tiny_llava, 1, SamplingParams(max_tokens=4)), "chatcmpl-1")
    wired = from_bytes(PrefillOutput, to_bytes(pre))
    assert (wired.request_key, wired.checksum) == ("chatcmpl-1", pre.checksum) and pre.checksum >= 0
    verify_handoff(wired, "chatcmpl-1")
    with pytest.raises(HandoffError, match="stale"):
        verify_handoff(wired, "chatcmpl-1#2")  # a re-issued attempt must not take the first attempt's KV
    for name in ("keys", "values"):
        altered = getattr(wired.kv, name).copy()
        altered.reshape(-1)[-1] += 1e-3  # the last value of the last block: shape and dtype intact
        with pytest.raises(HandoffError, match="corrupted"):
            verify_handoff(replace(wired, kv=replace(wired.kv, **{name: altered})), "chatcmpl-1")
    verify_handoff(replace(pre, request_key="", checksum=-1), "anything")  # unsealed (in-process paths): no claim
