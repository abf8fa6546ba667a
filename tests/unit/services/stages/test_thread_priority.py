"""Throughput work's threads: a raised niceness, and from ``IDLE_FROM`` on the ``SCHED_IDLE`` policy (Linux); a
process reniced as a whole keeps its policy. Run in a fresh interpreter: neither can be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, threading
from services.stages.threads import IDLE_FROM, nice_process, nice_thread

def policy_after(nice):
    seen = []
    def run():
        nice_thread(nice)
        tid = threading.get_native_id()
        seen.append([os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)])
    t = threading.Thread(target=run); t.start(); t.join()
    return seen[0]

out = {"below": policy_after(IDLE_FROM - 1), "at": policy_after(IDLE_FROM), "top": policy_after(19)}
nice_process(19)
me = threading.get_native_id()
out["process"] = [os.getpriority(os.PRIO_PROCESS, me), os.sched_getscheduler(me)]
print(json.dumps(out))
"""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_throughput_threads_run_under_sched_idle_from_the_threshold_and_a_reniced_process_keeps_its_policy():
    from services.stages.threads import IDLE_FROM

    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert got["below"] == [max(base, IDLE_FROM - 1), os.SCHED_OTHER]
    assert got["at"] == [max(base, IDLE_FROM), os.SCHED_IDLE] and got["top"] == [max(base, 19), os.SCHED_IDLE]
    assert got["process"] == [max(base, 19), os.SCHED_OTHER]
