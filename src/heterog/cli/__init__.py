"""The `heterog` command line: one module per command, registered in main.py."""
