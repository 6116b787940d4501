from snakeshard.cli import main

raise SystemExit(main())
