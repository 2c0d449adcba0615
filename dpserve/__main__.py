import sys

from dpserve.cli import main

sys.exit(main())
