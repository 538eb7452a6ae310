"""The command ``python -m policy_server``: the launcher's ``main`` (policy_server/launcher.py)."""

import sys

from policy_server.launcher import main

sys.exit(main())
