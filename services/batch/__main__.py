"""``python -m services.batch``: the offline video batch job (:mod:`services.batch.job`)."""

import sys

from services.batch.job import main

sys.exit(main())
