from epbench import launch

if launch.under_torchrun():
    launch.guard_rank()  # before the heavy imports: a signal during them ends the rank quietly
from epbench.cli import main  # noqa: E402

main()
