from exporter.cli import main

raise SystemExit(main())
