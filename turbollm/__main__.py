import sys

from turbollm.cli.main import main

if __name__ == "__main__":  # a worker process (spawn) re-imports this module under another name
    sys.exit(main())
