"""A sequence decoded in a batch gets the bits it gets alone: not only its tokens (``test_decode_engine.py``) but
every log-probability, exactly."""

from __future__ import annotations

import pytest
import torch

from common.engine.decode import DecodeEngine
from common.kv.pool import KVPool
from common.protocol.sampling import SamplingParams
from tests.unit.common.engine.test_decode_engine import _prefilled


def _logprobs(engine: DecodeEngine, requests) -> dict[str, list[tuple[int, float]]]:
    """Every request's (token, log-probability) pairs, all submitted at once and stepped to the end."""
    got: dict[str, list[tuple[int, float]]] = {rid: [] for rid, _, _ in requests}
    for request in requests:
        engine.submit(*request)
    while engine.has_work():
        for ev in engine.step():
            got[ev.request_id].append((ev.token_id, ev.logprob.logprob))
    return got


@pytest.mark.parametrize("model", ["tiny_llava", "tiny_qwen", "prism-small-llava"])
def test_a_sequence_in_a_batch_gets_the_bits_it_gets_alone(model, request, model_cache):
    """Batched equals unbatched down to the last bit of each log-probability (fp32, the decode step's native paths):
    every part of the step treats a sequence alone — the row kernel's products (a row's bits in any batch of up to
    32 rows: common/model/row_gemm.py), the attention kernel (one sequence per thread), the norms (one row each) and
    the sampler — so nothing a neighbour brings can move a sequence's floats. ``prism-small-llava`` (0.6 s to build)
    is the case that needs the row kernel: oneDNN rounds its 1408-input down projection differently for one row."""
    from common.model.row_gemm import load_row_gemm
    from tests.conftest import _load

    lm = request.getfixturevalue(model) if model.startswith("tiny") else _load(model, model_cache)
    if lm.dtype != torch.float32 or load_row_gemm() is None:
        pytest.skip("bit-level invariance is the row kernel's (fp32, AVX-512); tokens are checked above either way")
    requests = []
    for i in range(6):
        sampling = SamplingParams(max_tokens=5 + i, ignore_eos=True, logprobs=1)
        requests.append((f"req-{i}", _prefilled(lm, i, i % 2, sampling), sampling))
    alone = {}
    for request in requests:
        alone |= _logprobs(DecodeEngine(lm, KVPool(64, 16, lm.kv_shape, lm.dtype), max_batch=1), [request])
    batched = _logprobs(DecodeEngine(lm, KVPool(256, 16, lm.kv_shape, lm.dtype), max_batch=32), requests)
    assert batched == alone  # (exact floats, not approx)
    assert all(len(v) >= 5 for v in batched.values())
