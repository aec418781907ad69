"""`python -m trillm.engine.mock OUT.jsonl [...]`: write a synthetic mooncake-style trace."""

from trillm.engine.mock.trace import main

raise SystemExit(main())
