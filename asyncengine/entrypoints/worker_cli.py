"""`asyncengine worker`: starts this node's workers for an engine running on another node (the head).

    # on the head (node 0): an engine with nnodes=2 writes the CURVE key file and waits
    asyncengine serve -pp 2 -tp 2 --nnodes 2 --head-host 10.0.0.1 --head-port 29600 --key-file keys.json
    # copy keys.json to node 1 (it holds a secret: keep it 0600), then there:
    asyncengine worker --head 10.0.0.1:29600 --node-rank 1 --key-file keys.json --nproc 2

Port layout: the step broadcast is HEAD_PORT, the results HEAD_PORT + 1 (both CURVE over TCP). The
torch.distributed rendezvous address (head_host and a free port, or MASTER_ADDR / MASTER_PORT when
set on the head) and the whole EngineConfig arrive in the InitWorker message over that channel, so
nothing else is configured here; the model directory must exist at the same path on every node.

Ranks: node N runs ranks N * nproc .. N * nproc + nproc - 1, nproc = world_size / nnodes on the head.
The launcher supervises its workers: when one exits, the others are stopped and the launcher exits
with its code; when the launcher dies, its workers see their death pipe close and exit too. A worker
exits when its connection to the head drops (the head died) or the head refuses its keys.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from asyncengine.transport.channels import Endpoints
from asyncengine.transport.curve import KeyFileError, load_client_keys
from asyncengine.worker_procs import WorkerProcs

logger = logging.getLogger("asyncengine.worker_cli")

SUPERVISE_POLL_S = 0.2


def add_worker_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the `worker` subcommand; its handler is `run_worker(args)` (also set as `func`)."""
    parser = subparsers.add_parser(
        "worker",
        help="start this node's workers for a multi-node engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_worker_args(parser)
    parser.set_defaults(func=run_worker)
    return parser


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--head",
        required=True,
        metavar="HOST:PORT",
        help="the head's head_host:head_port (broadcast on PORT, results on PORT + 1)",
    )
    parser.add_argument("--node-rank", type=int, required=True, help="this node's index, 1 .. nnodes - 1")
    parser.add_argument("--key-file", required=True, help="the CURVE key file the head wrote")
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="workers on this node; must equal the head's world_size / nnodes "
        "(default: the number of visible GPUs, or 1 without any)",
    )


def parse_head(head: str) -> tuple[str, int]:
    """\"host:port" or "[v6::addr]:port" -> (host, port)."""
    host, sep, port = head.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"--head must be HOST:PORT with PORT in [1, 65534], got {head!r}")
    return host.strip("[]"), int(port)


def default_nproc() -> int:
    import torch  # only here: the launcher itself needs no torch otherwise

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def spawn_workers(endpoints: Endpoints, key_file: str, node_rank: int, nproc: int) -> WorkerProcs:
    """Starts ranks node_rank * nproc .. + nproc - 1 under one death pipe."""
    workers = WorkerProcs()
    ranks = [(node_rank * nproc + local, local) for local in range(nproc)]
    workers.start(ranks, endpoints, extra=["--curve-keys", key_file])
    return workers


def supervise(workers: WorkerProcs) -> int:
    """Waits until every worker has exited; the first non-zero exit stops the rest."""
    while True:
        codes = [p.poll() for p in workers.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c is not None for c in codes):
            if failed:
                logger.error("a worker exited with code %d: stopping this node's other workers", failed[0])
            workers.terminate()
            return failed[0] if failed else 0
        time.sleep(SUPERVISE_POLL_S)


def run_worker(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=os.environ.get("ASYNCENGINE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s node{args.node_rank} %(levelname)s %(message)s",
    )
    try:
        host, port = parse_head(args.head)
        keys = load_client_keys(args.key_file)
    except (ValueError, KeyFileError) as e:
        logger.error("%s", e)
        return 2
    if args.node_rank < 1:
        logger.error("--node-rank must be >= 1: node 0 is the head, which starts its own workers")
        return 2
    nproc = args.nproc if args.nproc is not None else default_nproc()
    if nproc < 1:
        logger.error("--nproc must be >= 1, got %d", nproc)
        return 2
    endpoints = Endpoints.tcp(host, port, keys)
    workers = spawn_workers(endpoints, os.path.abspath(args.key_file), args.node_rank, nproc)
    logger.info(
        "node %d: ranks %d..%d connecting to %s",
        args.node_rank,
        args.node_rank * nproc,
        args.node_rank * nproc + nproc - 1,
        endpoints.broadcast,
    )
    try:
        return supervise(workers)
    except KeyboardInterrupt:
        return 130
    finally:
        workers.terminate()
        workers.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncengine worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_worker_args(parser)
    return run_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
