from trillm.web.cli import main

raise SystemExit(main())
