"""``deployments.topology``: the groups, deployment names and per-request hops of every topology, media apart or
grouped with encode, and the refusal of ``MEP/D`` with its reason."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from common.config import PrismConfig
from common.config.topology import Topology, deployment_names, group_of, groups, hops, media_apart


def test_every_topology_names_its_deployments_in_request_order():
    assert deployment_names("E/P/D") == ["Media", "Encode", "Prefill", "Decode"]
    assert deployment_names("EPD") == ["Media", "EncodePrefillDecode"]
    assert deployment_names("ME/P/D") == ["MediaEncode", "Prefill", "Decode"]
    assert deployment_names("ME/PD") == ["MediaEncode", "PrefillDecode"]
    assert deployment_names("MEPD") == ["MediaEncodePrefillDecode"]


@pytest.mark.parametrize("topology", get_args(Topology))
def test_every_stage_is_held_once_and_media_goes_with_encode(topology):
    held = [stage for group in groups(topology) for stage in group]
    model = ["encode", "prefill", "decode"]
    assert held == (model if media_apart(topology) else ["media", *model])
    if not media_apart(topology):
        assert group_of(topology, "media") == group_of(topology, "encode")
        assert groups(topology)[0][:2] == ("media", "encode")


def test_a_text_request_skips_media_and_encode_wherever_they_sit():
    assert hops("ME/P/D", with_media=True) == [("media", "encode"), ("prefill",), ("decode",)]
    assert hops("ME/P/D", with_media=False) == [("prefill",), ("decode",)]
    assert hops("MEPD", with_media=True) == [("media", "encode", "prefill", "decode")]
    assert hops("MEPD", with_media=False) == [("prefill", "decode")]
    assert hops("EPD", with_media=False) == [("prefill", "decode")]


def test_mep_d_is_refused_with_its_reason():
    with pytest.raises(ValidationError, match="decode blocks"):
        PrismConfig.model_validate({"deployments": {"topology": "MEP/D"}})
    with pytest.raises(ValidationError, match="'E/P/D', 'E/PD', 'EP/D', 'EPD', 'ME/P/D', 'ME/PD' or 'MEPD'"):
        PrismConfig.model_validate({"deployments": {"topology": "E/M/PD"}})


def test_a_media_group_is_sized_for_both_stages():
    cfg = PrismConfig.model_validate({"deployments": {"topology": "ME/PD", "media": {"num_cpus": 0.3}}})
    stage = cfg.deployments.group_stage(groups("ME/PD")[0])
    assert stage.num_cpus == pytest.approx(0.3 + cfg.deployments.encode.num_cpus)
    d = cfg.deployments
    assert stage.max_ongoing_requests == d.encode.max_ongoing_requests + d.media.max_ongoing_requests
    whole = d.group_stage(groups("MEPD")[0])  # (a download holds one of media's slots, not one of decode's)
    assert whole.max_ongoing_requests == d.decode.max_ongoing_requests + d.media.max_ongoing_requests
    assert d.group_stage(groups("EPD")[0]).max_ongoing_requests == d.decode.max_ongoing_requests
