"""API keys from a file (a mounted Kubernetes Secret) are merged with the inline ones and checked the same way."""

from __future__ import annotations

import json

import pytest

from common.config import ServerConfig


def test_keys_file_is_merged_with_inline_keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-file": "tenant-b"}))
    server = ServerConfig(api_keys={"sk-inline": "tenant-a"}, api_keys_file=str(path))
    assert server.load_api_keys() == {"sk-inline": "tenant-a", "sk-file": "tenant-b"}
    assert "sk-file" not in server.model_dump_json()  # the Serve config only names the file


@pytest.mark.parametrize("content", ["[1, 2]", '{"k": 3}', '{"k": "bad tenant!"}'])
def test_malformed_keys_file_is_refused(tmp_path, content):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ValueError):
        ServerConfig(api_keys_file=str(path)).load_api_keys()
