"""A `nemo` for the shell scripts tests run (`nemo_bin()`, put first on their PATH): a client that has this test
session run the command through `commands.nemo`, a fork of the session's preloaded server, instead of a fresh
interpreter spending 10-15 s on imports, then prints the command's output and exits with its exit code.

The command gets the client's arguments, working directory and environment; its stdin is /dev/null; its output
(stdout and stderr together) comes when it ends, not as it is written. What it starts (torchrun and the ranks) are
real processes, as under a real `nemo`.
"""

import functools
import json
import socketserver
import sys
import tempfile
import threading
from pathlib import Path

from tests.helpers import commands

CLIENT = """#!{python} -I
import json, os, socket, sys
with socket.socket(socket.AF_UNIX) as sock:
    sock.connect({address!r})
    sock.sendall(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode())
    sock.shutdown(socket.SHUT_WR)
    reply = json.loads(b"".join(iter(lambda: sock.recv(1 << 16), b"")))
sys.stdout.write(reply["output"])
sys.exit(reply["returncode"])
"""


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        request = json.loads(self.rfile.read())
        result = commands.nemo(*request["argv"], cwd=request["cwd"], env=request["env"])
        self.wfile.write(json.dumps({"output": result.stdout, "returncode": result.returncode}).encode())


@functools.cache
def nemo_bin() -> Path:
    """A directory holding the `nemo` client; its server (a thread of this session) starts at the first call."""
    directory = Path(tempfile.mkdtemp(prefix="nemo-bin-"))
    address = str(directory / "socket")
    server = socketserver.ThreadingUnixStreamServer(address, _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = directory / "nemo"
    client.write_text(CLIENT.format(python=sys.executable, address=address))
    client.chmod(0o755)
    return directory
