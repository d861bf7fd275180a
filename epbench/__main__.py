from epbench.cli import main

main()
