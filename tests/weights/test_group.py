"""The distributed path's broken groups and torch.distributed's registry: a group whose peer died
is kept as it is, and taken out of the registry, so that another's ``destroy_process_group()``
(megatron-core's export, a test's teardown), which shuts down every registered group, does not
reach it. Shut down, such a group aborted the process at exit (SIGABRT): a test process that ran
``tests/weights/test_sync.py``'s lost-replica push and then a Megatron export died so.
``test_sync.py`` checks that the groups the path leaves behind in that push are out of the registry."""

import subprocess
import sys

from tests.helpers.paths import REPO

SCRIPT = r"""
import datetime, subprocess, sys, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from lightning_fasync.weights import wire
from lightning_fasync.fleet.launch import free_port

port = free_port()
timeout = datetime.timedelta(seconds=20)
peer = subprocess.Popen([sys.executable, "-c", (
    "import datetime, time; from lightning_fasync.weights import wire; "
    f"wire.init_custom_process_group('gloo', 'tcp://127.0.0.1:{port}', 2, 1, 'fasync-weights-test', "
    "timeout=datetime.timedelta(seconds=20)); time.sleep(60)")])
store = dist.TCPStore("127.0.0.1", port, 2, True, timeout, multi_tenant=True)  # the floors' torch takes no listen fd
pg = wire.init_custom_process_group("gloo", "", 2, 0, "fasync-weights-test", timeout=timeout, store=store)
peer.kill(); peer.wait()
try:
    pg.broadcast([torch.ones(1 << 20)]).wait()
except Exception:
    pass  # the peer is gone: the group is broken
kept = [pg, store]
FORGET and wire.forget_process_group(pg)
assert (pg in c10d._world.pg_map) != FORGET
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
dist.destroy_process_group()
print("exiting", flush=True)
"""


def _run(forget: bool):
    return subprocess.run([sys.executable, "-c", SCRIPT.replace("FORGET", str(forget))], capture_output=True,
                          text=True, cwd=REPO, timeout=180)


def test_a_broken_group_taken_out_of_the_registry_outlives_anothers_destroy_process_group():
    proc = _run(True)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "exiting" in proc.stdout
