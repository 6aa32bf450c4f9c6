import sys

from moe.plan.cli import main

sys.exit(main())
