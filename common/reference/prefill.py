"""Reference prefill: merged prompt embeddings → first token + the prompt's KV cache as blocks.

Runs the language model once over the whole prompt, unchunked and uncached — the oracle of
:mod:`common.engine.prefill` — with positions from the family adapter (1-D, or M-RoPE with its ``rope_delta``),
samples the first token from the last position's logits (step 0), and exports the cache with
:func:`common.kv.blocks.export_kv`. The result carries the model revision so decode can refuse KV from another model.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from common.grammar.compiler import compiler_for
from common.grammar.masks import MaskBuffer, mask_row
from common.kv.blocks import export_kv
from common.model.loader import LoadedModel
from common.protocol.handoff import MergedInputs, PrefillOutput
from common.protocol.sampling import SamplingParams
from common.stages.sampler import first_tokens, log_probs


def prefill(lm: LoadedModel, merged: MergedInputs, sampling: SamplingParams, block_size: int) -> PrefillOutput:
    with torch.inference_mode():
        token_ids = torch.from_numpy(merged.token_ids)
        embeds = torch.from_numpy(merged.inputs_embeds).to(lm.dtype)[None]
        positions, rope_delta = lm.adapter.prefill_positions(lm.model, token_ids, merged.spans)
        cache = DynamicCache(config=lm.text_config)
        out = lm.adapter.language_model(lm.model)(
            inputs_embeds=embeds, position_ids=positions, cache=cache, use_cache=True
        )
        logits = lm.model.lm_head(out.last_hidden_state[:, -1:, :])[0, -1]
        raw = log_probs(logits) if sampling.logprobs is not None else None
        if sampling.guide is not None:
            mask_row(logits, compiler_for(lm).matcher(sampling.guide), MaskBuffer(logits.shape[-1]))
        first, first_logprob, forks = first_tokens(logits, raw, sampling)
        kv = export_kv(cache, block_size)
    return PrefillOutput(
        prompt_token_ids=merged.token_ids,
        first_token_id=first,
        kv=kv,
        rope_delta=rope_delta,
        model_revision=lm.contract.model_revision,
        first_logprob=first_logprob,
        forks=forks,
    )
