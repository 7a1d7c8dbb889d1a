from rlbus.cli import main

main()
