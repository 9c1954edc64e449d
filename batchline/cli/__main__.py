"""``python -m batchline.cli``."""

from batchline.cli.app import main

if __name__ == "__main__":
    main()
