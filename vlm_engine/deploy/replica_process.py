"""`python -m vlm_engine.deploy.replica_process CONFIG`: one Serve replica's server, the whole
multi-process `vlm-engine serve`, run from a pickled `ServerConfig`. Its lifetime is tied to the
replica actor that started it (PDEATHSIG): a replica killed outright takes its server along."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys

from vlm_engine.server.procs import die_with_parent


def main(argv: list[str]) -> int:
    with open(argv[0], "rb") as f:
        config = pickle.load(f)  # written by our own replica actor a moment ago
    os.unlink(argv[0])
    die_with_parent(signal.SIGTERM)  # SIGTERM: the server drains, stops its children, exits
    from vlm_engine.server.launcher import serve

    code = serve(config)
    logging.shutdown()
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))
