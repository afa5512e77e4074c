"""`python -m moetrace.cli`: the moetrace command."""

from moetrace.cli import main

if __name__ == "__main__":
    main()
