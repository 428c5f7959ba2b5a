"""The `nqfjax` command (placeholder until the demo lands)."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nqfjax", description=__doc__)
    parser.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
