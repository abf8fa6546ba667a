"""The monolith's OS priorities are a grouped replica's: its media and encode stages nice only their own threads, so
its ingress, decode and prefill lanes run at the process's niceness (the long lane at its configured one), as Prism's
do. Run in a fresh interpreter: a renice cannot be
undone, and a regression must not leave this test process at niceness 19."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import asyncio, base64, json, os, sys, threading
import httpx
from loadtest.servers.monolith import build
from tests.mediakit import png_bytes

app = build({"model": {"model": "prism-tiny-llava", "cache_dir": sys.argv[1], "torch_threads": 1}})
image = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is this?"}]
body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": 4}

async def ask():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m", timeout=60) as http:
        return (await http.post("/v1/chat/completions", json=body)).status_code

status = asyncio.run(ask())
def prio(tid):
    return [os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)]
threads = {t.name: t.native_id for t in threading.enumerate()}
print(json.dumps({"status": status, "main": prio(threading.get_native_id()),
                  "encode": prio(threads["prism-encode_0"]), "decode": prio(threads["prism-decode_0"]),
                  "long_lane": prio(threads["prism-prefill-long_0"])}))
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_the_monolith_nices_its_throughput_threads_not_its_process(model_cache):
    from common.config import DeploymentsConfig
    from services.stages.threads import IDLE_FROM

    run = subprocess.run(
        [sys.executable, "-c", PROBE, model_cache], capture_output=True, text=True, timeout=300, cwd=os.getcwd()
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    base = os.getpriority(os.PRIO_PROCESS, 0)
    encode_nice = DeploymentsConfig().encode.cpu_nice
    assert got["status"] == 200
    assert got["main"] == [base, os.SCHED_OTHER] and got["decode"] == [base, os.SCHED_OTHER], got

    def niced(nice):
        return [max(base, nice), os.SCHED_IDLE if nice >= IDLE_FROM else os.SCHED_OTHER]

    assert got["encode"] == niced(encode_nice), got
    # The long prefill lane (the image prompt's) at its configured niceness: the replica's own by default
    assert got["long_lane"] == niced(DeploymentsConfig().prefill.long_lane_nice), got
