"""``python -m kvcompress.lmeval ARGS``: see ``kvcompress.lmeval.cli``."""

from kvcompress.lmeval.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
