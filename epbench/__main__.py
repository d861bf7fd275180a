import os
import signal

if "LOCAL_RANK" in os.environ:  # a rank: a SIGINT that comes before guard_rank ends it quietly too
    signal.signal(signal.SIGINT, signal.SIG_DFL)

from epbench import launch  # noqa: E402

if launch.under_torchrun():
    launch.guard_rank()  # before the heavy imports: a signal during them ends the rank quietly
from epbench.cli import main  # noqa: E402

main()
