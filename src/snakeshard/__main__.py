from snakeshard.job import main

raise SystemExit(main())
