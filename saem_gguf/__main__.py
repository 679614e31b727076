from saem_gguf.cli.main import main

raise SystemExit(main())
