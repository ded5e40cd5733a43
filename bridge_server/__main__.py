"""`python -m bridge_server ...` is `vllm-bridge ...`."""

import sys

from bridge_server.cli import main

if __name__ == "__main__":
    sys.exit(main())
