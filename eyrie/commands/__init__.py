"""The `eyrie` command line: its app, commands, options, display, the embedded default."""
