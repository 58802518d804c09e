"""How the torchrun test workers (dp_*_worker.py) end, once their result file is written.

Both ranks leave the process group together (``leave_process_group``: barrier, then destroy), then the process
ends with ``os._exit``, skipping the interpreter's finalisation and C++ static destructors. Why: after a clean
barrier + destroy_process_group, a rank still died at exit now and then with SIGABRT ("terminate called without an
active exception": a joinable std::thread destroyed during teardown), so torchrun failed a launch whose checks had
all passed — CI on 2026-11-25 (dp_equivalence_worker, rank 1), and 2 of 24 back-to-back launches on this machine,
then 0 of ~160 more; pytorch/pytorch#190489 and #179291 report the same message at interpreter exit with gloo. These
workers test numerics and collectives, not how a process exits; the product's own launches (`-m trainer.train`,
`parityrl sft`) exit normally and are tested as they are.
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn

from trainer.distributed.teardown import leave_process_group


def finish(code: int = 0) -> NoReturn:
    leave_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
