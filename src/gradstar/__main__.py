from gradstar.cli import main

raise SystemExit(main())
