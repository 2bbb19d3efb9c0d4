from estimator.allocator.cli import main

raise SystemExit(main())
