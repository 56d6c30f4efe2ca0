"""`python -m gptkit.infer.native --build [--record=FILE]`: build the native step for this CPU
(gptkit.infer.native.build.main)."""

import sys

from gptkit.infer.native.build import main

sys.exit(main(sys.argv[1:]))
