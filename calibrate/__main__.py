import sys

from calibrate.cli import main

sys.exit(main())
