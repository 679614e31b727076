"""Command line: `python -m saem_gguf <command>`. One module per subcommand."""
