"""Entry point of a delay-line engine process (testbed.net.delay_engine):
`python -m testbed.net.delayline_main CONFIG_JSON`.

Started by testbed.net.delayline, which hands it the lines' TAP descriptors over its channel;
not meant to be run by hand.
"""

from __future__ import annotations

import json
import sys

from testbed.net.delayline import serve


def main(argv: list[str]) -> int:
    serve(json.loads(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
