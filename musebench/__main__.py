from musebench.cli import main

main()
