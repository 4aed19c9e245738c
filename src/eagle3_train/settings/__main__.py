"""`python -m eagle3_train.settings --markdown`: print the config reference (docs/CONFIG.md)."""

from eagle3_train.settings import main

raise SystemExit(main())
