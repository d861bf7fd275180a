from epbench import launch

if launch.under_torchrun():
    launch.guard_rank()  # before the heavy imports: a signal during them ends the rank quietly
from epbench.cli import main  # noqa: E402

if launch.under_torchrun():
    try:
        main()
    except SystemExit as e:
        launch.leave_rank(e.code)
else:
    main()
