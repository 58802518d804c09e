"""leave_process_group: a multi-process launch leaves its group; one process keeps it (a colocated engine's).

Run in a child process: the test session's shared vLLM engine may own this process's default group.
"""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

CHILD = """
import os, sys, torch.distributed as dist
from trainer.distributed.teardown import leave_process_group
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
os.environ["WORLD_SIZE"] = "1"
leave_process_group()
kept = dist.is_initialized()
os.environ["WORLD_SIZE"] = "2"  # as under torchrun (the group here has one rank: the barrier returns at once)
leave_process_group()
print(kept, dist.is_initialized())
leave_process_group()  # nothing left to leave: no error
"""


def test_one_process_keeps_its_group_a_launch_leaves_it():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", CHILD, str(port)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"]
