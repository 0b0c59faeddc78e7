from fedbed.cli import main

main()
