import sys

try:
    from saem_gguf.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while Python imports the CLI: one line, as after it
    print("interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
