"""`python -m mesh coord ...` and `python -m mesh peer ...`: the console scripts without the installed wrappers."""
import sys

from mesh.cli import coord_main, peer_main

if __name__ == "__main__":
    commands = {"coord": coord_main, "peer": peer_main}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit("usage: python -m mesh {coord|peer} [flags]")
    commands[sys.argv[1]](sys.argv[2:])
