"""``ftagent arbiter``: the central process that decides for whole jobs.

It holds no state of its own: agents re-register after it restarts, so running it is
``ftagent arbiter --listen 0.0.0.0:9400 --token $SECRET`` in a Deployment. On start it
prints ``listening on HOST:PORT`` on stderr (the port actually bound, also for port 0).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass

from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.server import ArbiterServer, ServerSettings, serve_until
from ftagent.config import (
    ConfigError,
    OneLineParser,
    add_group,
    non_negative,
    opt,
    port_or_off,
    positive,
    resolve_group,
)


def listen_address(v: str) -> str:
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError("is not HOST:PORT (port 0 picks a free port)")
    return v


@dataclass(frozen=True)
class ArbiterConfig:
    """Flags of ``ftagent arbiter`` (each also an FTAGENT_* variable)."""

    listen: str = opt("0.0.0.0:9400", "--listen", "gRPC address agents and `ftagent status` "
                      "connect to; port 0 picks a free port", check=listen_address,
                      metavar="HOST:PORT")
    max_restarts: int = opt(
        3, "--max-restarts", "restarts allowed per job (all ranks together) before it is "
        "stopped; an agent's own --max-restarts overrides it for its job",
        check=non_negative, metavar="N")
    barrier_timeout: float = opt(
        300.0, "--barrier-timeout", "seconds a (re)start waits for every rank to arrive "
        "before the job is stopped, naming the missing ranks", check=positive,
        metavar="SECONDS")
    nic_replace_after: float = opt(
        300.0, "--nic-replace-after", "a rank whose link stays down this long is replaced "
        "(its pod exits with the replace code)", check=positive, metavar="SECONDS")
    stacks_timeout: float = opt(
        15.0, "--stacks-timeout", "on a job hang, how long to wait for every rank's stacks "
        "before restarting without them", check=positive, metavar="SECONDS")
    token: str = opt("", "--token", "shared secret agents and `ftagent status` must send "
                     "(prefer the FTAGENT_TOKEN variable: flags show in ps)", metavar="SECRET")
    tls_cert: str = opt("", "--tls-cert", "server certificate (enables TLS)", metavar="PATH")
    tls_key: str = opt("", "--tls-key", "server private key", metavar="PATH")
    tls_client_ca: str = opt("", "--tls-client-ca", "CA that agents' client certificates "
                             "must chain to (enables mutual TLS)", metavar="PATH")
    metrics_port: int = opt(
        9431, "--metrics-port", "Prometheus /metrics port; 0 picks a free port, -1 turns "
        "metrics off", check=port_or_off, metavar="PORT")
    metrics_addr: str = opt("0.0.0.0", "--metrics-addr", "address /metrics listens on",
                            metavar="ADDR")
    log_level: str = opt("info", "--log-level", "the arbiter's messages on stderr",
                         choices=("debug", "info", "warning", "error"))

    def settings(self) -> ServerSettings:
        return ServerSettings(
            listen=self.listen, token=self.token, tls_cert=self.tls_cert,
            tls_key=self.tls_key, tls_client_ca=self.tls_client_ca,
            metrics_port=self.metrics_port, metrics_addr=self.metrics_addr,
            policy=PolicyConfig(max_restarts=self.max_restarts,
                                barrier_timeout=self.barrier_timeout,
                                nic_replace_after=self.nic_replace_after,
                                stacks_timeout=self.stacks_timeout))


def parse(argv: list[str], environ: dict[str, str] | None = None) -> ArbiterConfig:
    parser = OneLineParser(prog="ftagent arbiter", description=__doc__.splitlines()[0])
    add_group(parser, "arbiter", ArbiterConfig)
    ns = parser.parse_args(argv)
    return resolve_group(ns, ArbiterConfig, os.environ if environ is None else environ)


async def run(cfg: ArbiterConfig) -> int:
    server = ArbiterServer(cfg.settings())
    try:
        address = await server.start()
    except (OSError, ValueError) as e:
        sys.stderr.write(f"ftagent arbiter: error: {e}\n")
        return 1
    sys.stderr.write(f"listening on {address}\n")
    if server.metrics_port:
        sys.stderr.write(f"metrics on http://{cfg.metrics_addr}:{server.metrics_port}/metrics\n")
    sys.stderr.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve_until(server, stop)
    return 0


def main(argv: list[str]) -> int:
    try:
        cfg = parse(argv)
    except ConfigError as e:
        sys.stderr.write(f"ftagent arbiter: error: {e}\n")
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(cfg))
