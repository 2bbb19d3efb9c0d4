from estimator.io.cli import main

raise SystemExit(main())
