from rlbus.runners.cli import main

main()
