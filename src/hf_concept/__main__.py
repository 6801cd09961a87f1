import sys

from hf_concept.cli import main

sys.exit(main())
