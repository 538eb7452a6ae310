"""``python -m capture.viewer_http OUT [--tokenizer DIR] [--port N]``, as users run it: the
offline viewer of ``capture.viewer.http``."""

import sys

from capture.viewer.http import main

if __name__ == "__main__":
    sys.exit(main())
