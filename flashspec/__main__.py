from flashspec.cli import main

main()
