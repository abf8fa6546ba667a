"""The README's two requests, run as written against ``make serve``'s default application — only its address and the
API key the test app sets put in: the ``curl`` command and the ``openai`` client snippet both get an answer."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.paths import ROOT
from tests.served import API_KEY


def _block(language: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    return next(b for b in blocks if "chat/completions" in b or "chat.completions" in b)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_the_readme_curl_request_is_answered(served):
    command = _block("bash").replace("localhost:8000", served["base"].removeprefix("http://"))
    command = command.replace("curl -s ", f"curl -s -H 'authorization: Bearer {API_KEY}' ", 1)
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
    assert answer["usage"]["completion_tokens"] >= 1


def test_the_readme_client_snippet_streams_an_answer(served):
    code = _block("python").replace("http://127.0.0.1:8000", served["base"])
    code = code.replace("unused-unless-keys-configured", API_KEY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout, "the stream printed no text"
