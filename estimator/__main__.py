from estimator.cli import main

raise SystemExit(main())
