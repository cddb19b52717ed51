"""`python -m gpipe_cli`: the `gpipe` command, through the entry point that makes a Ctrl-C while loading one line."""

from gpipe_cli.entry import main

main()
