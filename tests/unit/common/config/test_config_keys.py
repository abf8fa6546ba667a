"""API keys from a file (a mounted Kubernetes Secret) are merged with the inline ones and checked the same way."""

from __future__ import annotations

import json

import pytest

from common.auth import KeyStore
from common.config import ServerConfig, read_keys_file


def test_keys_file_is_merged_with_inline_keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-file": "tenant-b"}))
    server = ServerConfig(api_keys={"sk-inline": "tenant-a"}, api_keys_file=str(path))
    store = KeyStore(server)
    assert (store.tenant("sk-inline"), store.tenant("sk-file")) == ("tenant-a", "tenant-b")
    assert "sk-file" not in server.model_dump_json()  # the Serve config only names the file


@pytest.mark.parametrize("content", ["[1, 2]", '{"k": 3}', '{"k": "bad tenant!"}'])
def test_malformed_keys_file_is_refused(tmp_path, content):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ValueError):
        read_keys_file(str(path))


def test_several_models_validate_and_split_per_model():
    from common.config import PrismConfig

    raw = {
        "models": [{"model": "prism-tiny-llava"}, {"model": "prism-tiny-qwen2vl", "served_name": "qwen",
                                                      "deployments": {"decode": {"num_cpus": 0.3}}}],
        "deployments": {"ingress": {"num_cpus": 0.05}},
    }  # fmt: skip
    cfg = PrismConfig.model_validate(raw)
    assert PrismConfig.model_validate(cfg.model_dump(mode="json")) == cfg, "a dumped config validates again"
    subs = cfg.served()
    assert [s.model.name for s in subs] == ["prism-tiny-llava", "qwen"]
    assert subs[1].deployments.decode.num_cpus == 0.3 and subs[0].deployments.decode.num_cpus == 0.25
    assert all(s.deployments.ingress.num_cpus == 0.05 and not s.models for s in subs)
    assert PrismConfig().served() == [PrismConfig()]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"model": {"model": "x"}, "models": [{"model": "prism-tiny-llava"}]}, "either `model`"),
        ({"models": [{"model": "prism-tiny-llava"}, {"model": "prism-tiny-llava"}]}, "distinct names"),
        ({"models": [{"model": "prism-tiny-llava"}], "deployments": {"decode": {"num_cpus": 1}}}, "models[i]"),
    ],
)
def test_several_models_refuse_ambiguous_configs(raw, message):
    from pydantic import ValidationError

    from common.config import PrismConfig

    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("`", "`")):
        PrismConfig.model_validate(raw)


def test_model_names_must_stay_distinct_as_deployment_names():
    from pydantic import ValidationError

    from common.config import PrismConfig

    raw = {"models": [{"model": "prism-tiny-llava", "served_name": "a.b"}, {"model": "prism-tiny-qwen2vl",
                                                                          "served_name": "a_b"}]}  # fmt: skip
    with pytest.raises(ValidationError, match="also as deployment names"):
        PrismConfig.model_validate(raw)


@pytest.mark.parametrize("header", ["²", "1" * 40, "-5", "soon", "0"])
def test_deadline_header_garbage_is_a_400_not_a_500(header):
    from common.config import PrismConfig
    from common.errors import InvalidRequestError
    from services.ingress.plan import deadline

    with pytest.raises(InvalidRequestError) as info:
        deadline(PrismConfig(), header, now=0.0)
    assert info.value.param == "X-Prism-Deadline-Ms"
