"""A real Flower deployment on this machine: one SuperLink and one SuperNode per client on
127.0.0.1, the job submitted with ``flwr run``; every process stopped by its PID afterwards.

What runs where (the same layout across machines, see the README's "Running across machines"):
the SuperLink and the ServerApp (server side: the method's ServerStrategy, evaluation); one
SuperNode per site, each running the ClientApp (the method's ClientTrainer on that site's data,
its client id given by ``--node-config "partition-id=K"``). Only parameters and scalar metrics
travel between them.

With TLS, only registered sites join (Flower's SuperNode authentication): the SuperLink runs with
``--enable-supernode-auth``, each site's SuperNode signs its requests with its own EC private key
(:func:`write_site_key`), and the SuperLink admits only the SuperNodes whose public key was
registered with ``flwr supernode register`` (:func:`register_site`); it refuses any other, and
the launcher says so after the run (:func:`refused_supernodes`).
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from fedbed.config import ConfigError, ExperimentConfig, ValidatedConfig, as_validated
from fedbed.flower.apps import (
    BACKEND_KEY,
    DISCOVERY_TIMEOUT,
    DISCOVERY_TIMEOUT_KEY,
    ROUND_TIMEOUT_KEY,
    SITE_KEYS_KEY,
    VALIDATED_KEY,
    settings_as_run_config,
)
from fedbed.federation import phase_timings
from fedbed.flower.common import OFFLINE_ENVIRONMENT, FlowerError, key_fingerprint
from fedbed.run_directory import FLOWER_LOGS, SUMMARY_NAME

CONNECTION = "fedbed"
SUPEREXEC_POLL_VARIABLE = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
"""Flower's setting of how often a SuperExec asks for a task to launch, in seconds (1 by default)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_certificates(folder: Path) -> dict[str, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 / localhost, signed by it.

    Returns:
        Paths ``ca`` (the CA certificate the SuperNodes and ``flwr`` trust), ``certificate`` and
        ``key`` (the SuperLink's), all PEM.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5), not_valid_after=now + datetime.timedelta(days=2))

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("FedBed test CA")).issuer_name(name("FedBed test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    alt = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    certificate = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
                   .add_extension(alt, critical=False).sign(ca_key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"ca": folder / "ca.crt", "certificate": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["certificate"].write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


def write_site_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A site's key pair for Flower's SuperNode authentication: an EC key on NIST P-384 (the
    curve of Flower's own guide; the SuperLink takes any NIST curve), as ``ssh-keygen -t ecdsa
    -b 384`` writes it.

    Returns:
        ``(private, public)``: ``folder/name``, the private key in OpenSSH format, readable by
        its owner only (the SuperNode's ``--auth-supernode-private-key``), and
        ``folder/name.pub``, the public key as one OpenSSH line (what the operator registers
        with ``flwr supernode register``).
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    folder.mkdir(parents=True, exist_ok=True)
    private, public = folder / name, folder / f"{name}.pub"
    descriptor = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
                       + b"\n")
    return private, public


def site_key_pairs(folder: Path, count: int) -> list[tuple[Path, Path]]:
    """The key pairs of ``count`` sites, ``folder/site-K`` and ``folder/site-K.pub`` (K = 0 ..
    count - 1), each made by :func:`write_site_key` unless it is there."""
    return [(folder / f"site-{site}", folder / f"site-{site}.pub") if (folder / f"site-{site}.pub").exists()
            else write_site_key(folder, f"site-{site}") for site in range(count)]


def register_site(public_key: Path, environment: dict[str, str], connection: str = CONNECTION) -> int:
    """Register a site's public key with the SuperLink of ``connection`` (``flwr supernode
    register``, through the SuperLink's Control API), so that the SuperNode holding the matching
    private key may join; return the node id the SuperLink gave it.

    Raises:
        FlowerError: the SuperLink did not register the key (Flower's message is quoted).
    """
    command = [str(Path(sys.executable).parent / "flwr"), "supernode", "register", str(public_key), connection,
               "--format", "json"]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120)
    try:
        answer = json.loads(finished.stdout[finished.stdout.index("{"):])
    except ValueError:
        answer = {}
    if finished.returncode != 0 or not answer.get("success"):
        said = " | ".join(line.strip() for line in (finished.stdout + finished.stderr).splitlines() if line.strip())
        raise FlowerError(f"the SuperLink did not register {public_key} (flwr exit code {finished.returncode}): {said}")
    return int(answer["node-id"])


_REFUSED = re.compile(r"/v1/fleet/activate-node.*public key: (b'[^']*').*No SuperNode found with the given public key")


def refused_supernodes(superlink_log: Path) -> list[str]:
    """The public keys (PEM text) of the SuperNodes that the SuperLink of ``superlink_log``
    refused because their key is not registered (SuperNode authentication: Flower 1.41 logs each
    refused activation with the key), each once, in the order of their first attempt; empty when
    the log cannot be read."""
    try:
        text = superlink_log.read_text(errors="replace")
    except OSError:
        return []
    keys = (ast.literal_eval(match.group(1)).decode("ascii", errors="replace") for match in _REFUSED.finditer(text))
    return list(dict.fromkeys(keys))


def toml_key(key: str) -> str:
    """A dotted run-config key in TOML, each part quoted (setting names are plain; domain names
    in keys need not be)."""
    return ".".join(json.dumps(part) for part in key.split("."))


def toml_value(value: Any) -> str:
    """A run-config value in TOML: strings as basic strings, booleans lower-case, numbers as written.

    Raises:
        TypeError: a value TOML's run config cannot hold (a list or a mapping).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"a Flower run config holds strings, numbers and booleans, not {type(value).__name__}: {value!r}")


def write_app(folder: Path, config: ExperimentConfig | ValidatedConfig, backend: str = "flower-deployment",
              round_timeout: float = 3600.0, discovery_timeout: float = DISCOVERY_TIMEOUT,
              site_keys: list[Path] | None = None) -> Path:
    """A Flower App folder (``pyproject.toml`` only) whose components are FedBed's apps and whose
    run config carries each setting of ``config`` as its own key (``fedbed.<setting>``,
    :func:`fedbed.flower.apps.settings_as_run_config`; ``flwr run --run-config`` overrides one),
    the marker that they were validated (their digest, :data:`fedbed.flower.apps.VALIDATED_KEY`:
    the apps do not validate them again unless a setting was overridden), the backend, the
    round timeout in seconds (a client silent for that long is dropped from the round) and the
    discovery timeout in seconds (how long the ServerApp waits for every site to say its client
    id, :class:`fedbed.flower.apps.FlowerClients`); ``flwr run FOLDER`` submits it. With
    ``site_keys`` (each site's public key file in partition-id order, the keys registered with the
    SuperLink), client K is only the SuperNode that signs with site K's key: their fingerprints go
    into the run config (:data:`fedbed.flower.apps.SITE_KEYS_KEY`).

    Raises:
        ConfigError: ``config`` is not validated yet and fails :func:`fedbed.config.validate`, or
            a site key file is not a public key (PEM or OpenSSH).
    """
    validated = as_validated(config).with_absolute_paths()
    config = validated.config
    fingerprints = None if site_keys is None else [_fingerprint_of_file(path) for path in site_keys]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(
        "[build-system]\nrequires = [\"hatchling\"]\nbuild-backend = \"hatchling.build\"\n\n"
        "[project]\nname = \"fedbed-job\"\nversion = \"1.0.0\"\ndependencies = []\n\n"
        "[tool.hatch.build.targets.wheel]\npackages = [\".\"]\n\n"
        "[tool.flwr.app]\npublisher = \"fedbed\"\n\n"
        "[tool.flwr.app.components]\nserverapp = \"fedbed.flower.apps:server_app\"\n"
        "clientapp = \"fedbed.flower.apps:client_app\"\n\n"
        "[tool.flwr.app.config]\n"
        + "".join(f"{toml_key(key)} = {toml_value(value)}\n" for key, value in settings_as_run_config(config).items())
        + f"{VALIDATED_KEY} = \"{validated.digest}\"\n"
        f"{BACKEND_KEY} = \"{backend}\"\n"
        f"{ROUND_TIMEOUT_KEY} = {float(round_timeout)}\n"
        f"{DISCOVERY_TIMEOUT_KEY} = {float(discovery_timeout)}\n"
        + ("" if fingerprints is None else f"{SITE_KEYS_KEY} = {toml_value(json.dumps(fingerprints))}\n")
    )
    return folder


def _fingerprint_of_file(path: Path) -> str:
    """:func:`fedbed.flower.common.key_fingerprint` of a key file; a file that is not a public key is a ConfigError."""
    try:
        return key_fingerprint(path.read_bytes())
    except (OSError, ValueError) as error:
        raise ConfigError(f"site key {path}: {error}; give each site's public key file (site-K.pub, from ssh-keygen "
                          "-t ecdsa -b 384), in partition-id order") from None


class Processes:
    """Processes started for one deployment, each in its own session so that its children
    (Flower's ServerApp and ClientApp subprocesses) are stopped with it; a process started
    ``beside`` another is stopped with that one (a SuperNode's long-running ClientApp process,
    :mod:`fedbed.flower.clientapp_process`)."""

    def __init__(self, log_dir: Path, environment: dict[str, str]) -> None:
        self.log_dir, self.environment = log_dir, environment
        self.started: dict[str, subprocess.Popen] = {}
        self.companions: dict[str, list[subprocess.Popen]] = {}

    def start(self, name: str, command: list[str], beside: str | None = None) -> subprocess.Popen:
        # The process runs in the launcher's working directory, as an in-process run does, so that
        # relative paths it is given (a dataset folder, a tracker's file store) mean the same files.
        with (self.log_dir / f"{name}.log").open("w") as log:  # the child keeps its own descriptor
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.environment,
                                       start_new_session=True)
        if beside is None:
            self.started[name] = process
        else:
            self.companions.setdefault(beside, []).append(process)
        return process

    def stop(self, name: str) -> None:
        """Stop one process, the processes started beside it and their children: SIGTERM to
        their groups, SIGKILL after 10 s."""
        self._stop([self.started[name], *self.companions.get(name, [])])

    def stop_all(self) -> None:
        """Stop every process (all asked at once, the last started first), as :meth:`stop`."""
        self._stop([member for name in reversed(list(self.started))
                    for member in (self.started[name], *self.companions.get(name, []))])

    @staticmethod
    def _stop(members: list[subprocess.Popen]) -> None:
        # Flower starts the SuperLink's SuperExec in a session of its own (and the ServerApp's
        # process in the SuperExec's group): such groups are stopped too, rather than left running
        # until they notice that their parent is gone. A member already reaped (stopped on its
        # own earlier) is not searched: its PID may belong to another process by now.
        leaders = [leader for member in members if member.poll() is None for leader in _detached_descendants(member.pid)]
        for pid in [member.pid for member in members] + [leader.pid for leader in leaders]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for member in members:
            try:
                member.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(member.pid, signal.SIGKILL)
                member.wait()
            with contextlib.suppress(ProcessLookupError):  # children left behind in the group
                os.killpg(member.pid, signal.SIGKILL)
        psutil.wait_procs(leaders, timeout=max(0.0, deadline - time.monotonic()))
        for leader in leaders:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader.pid, signal.SIGKILL)

    def pids(self) -> list[int]:
        return [p.pid for p in self.started.values()] + [p.pid for group in self.companions.values() for p in group]


def _detached_descendants(pid: int) -> list[psutil.Process]:
    """The descendants of process ``pid`` that lead a process group of their own (started in a
    new session), whom a signal to ``pid``'s group does not reach."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    leaders = []
    for descendant in descendants:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(descendant.pid) == descendant.pid:
                leaders.append(descendant)
    return leaders


def last_lines(log: Path, count: int = 3) -> str:
    """The last ``count`` non-empty lines of a log joined by `` | `` (empty if it cannot be read)."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-count:])


def keep_logs(work_dir: Path, run_dir: Path) -> Path:
    """Copy the deployment's logs (``*.log`` of ``work_dir``) into ``run_dir/``:data:`FLOWER_LOGS` before
    a temporary ``work_dir`` is deleted, so the evidence of a failure outlives it; return the copy."""
    kept = run_dir / FLOWER_LOGS
    kept.mkdir(parents=True, exist_ok=True)
    for log in work_dir.glob("*.log"):
        shutil.copy2(log, kept / log.name)
    return kept


def _wait_for_port(port: int, process: subprocess.Popen, what: str, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise FlowerError(f"{what} exited with code {process.returncode}; its log: {log}; last lines: {last_lines(log)}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise FlowerError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s; its log: {log}")


@contextlib.contextmanager
def local_federation(num_clients: int, work_dir: Path, tls: bool = False, data_roots: list[Path] | None = None,
                     simulation: bool = False) -> Iterator[tuple[Processes, dict[str, str]]]:
    """Start a SuperLink and ``num_clients`` SuperNodes on 127.0.0.1 (partition-id 0..N-1), each
    SuperNode with its long-running ClientApp process beside it (``--isolation process``,
    :mod:`fedbed.flower.clientapp_process`: the site builds its data and model once per run);
    yield the processes and the environment for ``flwr`` (private ``FLWR_HOME`` holding the
    connection); stop every process on exit, also on Ctrl-C and on failure.

    Args:
        num_clients: SuperNodes to start.
        simulation: a SuperLink that runs each submitted run on Flower's simulation engine
            (``--simulation``, as ``flwr run`` against a local simulation federation: Ray actors
            in place of SuperNodes); give ``num_clients`` 0.
        work_dir: logs, ``FLWR_HOME``, certificates and the sites' keys go here.
        tls: generate a self-signed CA and certificates at start-up and use them, and admit
            only registered SuperNodes: the SuperLink runs with ``--enable-supernode-auth``, each
            site's key pair (``work_dir/site-keys/site-K`` and ``site-K.pub``, made by
            :func:`write_site_key` unless there) is registered (:func:`register_site`) before its
            SuperNode starts with it; else insecure, admitting any SuperNode (Flower allows
            authentication over TLS only).
        data_roots: per SuperNode, the data root it reads (``FEDBED_DATA``); default: inherited.

    Raises:
        FlowerError: a process exits or does not listen in time (its log is named), or the
            SuperLink does not register a site's key.
    """
    home = work_dir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(sys.executable).parent
    # The SuperLink and the SuperNodes start flower-superexec, flwr-serverapp and flwr-clientapp by
    # name: the running environment's bin/ comes first on their PATH, activated or not (cron,
    # systemd and pipx call the fedbed script by its full path without activating anything).
    # The SuperLink's SuperExec asks for the ServerApp's (or the simulation's) task every 0.1 s,
    # not every second.
    environment = {SUPEREXEC_POLL_VARIABLE: "0.1", **os.environ, **OFFLINE_ENVIRONMENT, "FLWR_HOME": str(home),
                   "PATH": os.pathsep.join([str(bin_dir), *filter(None, [os.environ.get("PATH")])])}
    port = free_port()  # Flower 1.41 serves the Fleet, Control and Runtime APIs over one HTTP port
    security = ["--insecure"]
    connection = "insecure = true\n"
    node_security = ["--insecure"]
    if tls:
        certificates = write_certificates(work_dir / "certificates")
        security = ["--ssl-ca-certfile", str(certificates["ca"]), "--ssl-certfile", str(certificates["certificate"]),
                    "--ssl-keyfile", str(certificates["key"]), "--enable-supernode-auth"]
        connection = f"root-certificates = {json.dumps(str(certificates['ca']))}\n"
        node_security = ["--root-certificates", str(certificates["ca"])]
    (home / "config.toml").write_text(
        f"[superlink]\ndefault = \"{CONNECTION}\"\n\n[superlink.{CONNECTION}]\naddress = \"127.0.0.1:{port}\"\n{connection}"
    )
    processes = Processes(work_dir, environment)
    try:
        began = time.perf_counter()
        link = processes.start("superlink", [
            str(bin_dir / "flower-superlink"), *security, *(["--simulation"] if simulation else []),
            "--isolation", "subprocess", "--host", "127.0.0.1", "--port", str(port),
        ])
        _wait_for_port(port, link, "flower-superlink", work_dir / "superlink.log")
        phase_timings.record("federation_start", time.perf_counter() - began, role="launcher", what="superlink")
        key_flags: list[list[str]] = [[] for _ in range(num_clients)]
        if tls:  # every site's key registered before any starts (a flwr process each: one per core at a time)
            pairs = site_key_pairs(work_dir / "site-keys", num_clients)
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(num_clients, os.cpu_count() or 1)) as pool:
                list(pool.map(lambda pair: register_site(pair[1], environment), pairs))
            key_flags = [["--auth-supernode-private-key", str(private)] for private, _ in pairs]
        for client in range(num_clients):
            node_environment = dict(environment)
            if data_roots is not None:
                node_environment["FEDBED_DATA"] = str(data_roots[client])
            processes.environment = node_environment
            # Each SuperNode serves its own Runtime API (where its ClientApp process connects) on
            # its own port: two on one port, the second exits.
            runtime_port = free_port()
            processes.start(f"supernode-{client}", [
                str(bin_dir / "flower-supernode"), *node_security, *key_flags[client], "--superlink", f"127.0.0.1:{port}",
                "--node-config", f"partition-id={client} num-partitions={num_clients}",
                "--isolation", "process", "--host", "127.0.0.1", "--port", str(runtime_port),
            ])
            # The sites share this machine's cores: each trains on its share of them (unless the
            # caller set OMP_NUM_THREADS), rather than all on all of them.
            processes.environment = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // num_clients)),
                                     **node_environment}
            processes.start(f"clientapp-{client}", [
                sys.executable, "-m", "fedbed", "flower-clientapp", "--runtime-api-address", f"127.0.0.1:{runtime_port}",
            ], beside=f"supernode-{client}")
        processes.environment = environment
        yield processes, environment
    finally:
        processes.stop_all()


def run_flower_deployment(config: ExperimentConfig | ValidatedConfig, *, tls: bool = False, progress: bool = False,
                          echo: Callable[..., Any] = print, work_dir: Path | None = None,
                          timeout: float = 86400.0, round_timeout: float = 3600.0,
                          discovery_timeout: float = DISCOVERY_TIMEOUT,
                          site_data_roots: list[Path] | None = None) -> dict[str, Any]:
    """Run ``config`` on a real Flower deployment on this machine (SuperLink + one SuperNode per
    client on 127.0.0.1), streaming the ServerApp's log; return the run's summary. With ``tls``,
    only the sites it registers join (:func:`local_federation`); a SuperNode the SuperLink
    refused meanwhile (a stranger's, its key not registered) is named in one line after the run,
    and the deployment's logs are kept in ``<run_dir>/flower-logs``.

    Args:
        config: the run: validated settings (:func:`fedbed.config.validate`, as
            :func:`fedbed.backends.run_on_backend` hands them), or a config, validated here. They
            reach the ServerApp and the ClientApps (other processes, possibly on other machines)
            with their digest, so that those do not validate them again
            (:func:`fedbed.config.validated_settings`).
        site_data_roots: per client, the data root its SuperNode reads (``$FEDBED_DATA``), as
            sites on other machines would, e.g. each holding only its own domain (data spread
            over machines: ``domain_names`` / ``class_names``); the server reads this process's
            ``$FEDBED_DATA``. ``None``: every process reads the config's data root.
        round_timeout, discovery_timeout: seconds, as :func:`write_app`'s.

    Raises:
        ConfigError: invalid settings; ``site_data_roots`` with a ``data_root`` in the config
            (which every process would read instead) or not one per client.
        FlowerError: a Flower process failed, or the run ended without a summary; the logs are
            copied into ``<run_dir>/flower-logs`` (:func:`keep_logs`), which the message names,
            with the last lines of the failing log.
    """
    validated = as_validated(config).with_absolute_paths()
    config = validated.config
    num_clients = validated.num_clients  # no data read here: the ServerApp and each site read their own
    if site_data_roots is not None and (config.data_root is not None or len(site_data_roots) != num_clients):
        raise ConfigError(f"site_data_roots needs one data root per client ({num_clients}) and no data_root in the config "
                          "(each process reads its own $FEDBED_DATA)")
    summary_path = config.resolved_run_dir() / SUMMARY_NAME
    summary_path.unlink(missing_ok=True)
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedbed-flower-")))
        # With TLS the sites' keys are made first: the app pins each client to its site's key.
        site_keys = [public for _, public in site_key_pairs(work_dir / "site-keys", num_clients)] if tls else None
        app = write_app(work_dir / "app", validated, round_timeout=round_timeout, discovery_timeout=discovery_timeout,
                        site_keys=site_keys)
        try:
            summary = _deploy(config, app, num_clients, work_dir, tls, progress, echo, timeout, summary_path,
                              site_data_roots)
        except FlowerError as error:
            kept = keep_logs(work_dir, config.resolved_run_dir())
            raise FlowerError(str(error).replace(str(work_dir), str(kept))) from None
        refused = refused_supernodes(work_dir / "superlink.log")
        if refused:
            kept = keep_logs(work_dir, config.resolved_run_dir())
            echo(f"flower-deployment: the SuperLink refused {len(refused)} SuperNode{'s' if len(refused) > 1 else ''} whose "
                 f"key is not registered (SuperNode authentication); the run went on with the registered sites; "
                 f"their public keys are in {kept / 'superlink.log'}")
        return summary


def _deploy(config: ExperimentConfig, app: Path, num_clients: int, work_dir: Path, tls: bool, progress: bool,
            echo: Callable[..., Any], timeout: float, summary_path: Path,
            site_data_roots: list[Path] | None) -> dict[str, Any]:
    """Start the local federation, run the app on it with ``flwr run`` and return the summary."""
    with local_federation(num_clients, work_dir, tls=tls, data_roots=site_data_roots) as (_, environment):
        echo(f"flower-deployment: SuperLink and {num_clients} SuperNodes on 127.0.0.1{' with TLS, registered sites only' if tls else ''}; logs in {work_dir}")
        return submit_run(app, environment, work_dir, progress, timeout, summary_path)


def submit_run(app: Path, environment: dict[str, str], work_dir: Path, progress: bool, timeout: float, summary_path: Path,
               federation_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Submit the Flower App folder ``app`` to the local federation's SuperLink with ``flwr run
    --stream`` (``environment`` from :func:`local_federation`), wait for the run to end and return
    the summary the ServerApp wrote to ``summary_path``.

    Args:
        progress: show ``flwr``'s stream (the ServerApp's log) instead of keeping it.
        timeout: seconds the run may take.
        federation_config: ``flwr run --federation-config`` entries (a simulation's
            ``num-supernodes``, its Ray resources).

    Raises:
        FlowerError: the run did not end within ``timeout``, or ended without a summary (the
            last lines of ``flwr``'s output are quoted).
    """
    command = [str(Path(sys.executable).parent / "flwr"), "run", str(app), CONNECTION, "--stream"]
    if federation_config:
        command += ["--federation-config", " ".join(f"{key}={toml_value(value)}" for key, value in federation_config.items())]
    try:
        finished = subprocess.run(command, env=environment, cwd=work_dir, timeout=timeout,
                                  stdout=None if progress else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired:
        raise FlowerError(f"the Flower run did not finish within {timeout:.0f} s; logs in {work_dir}") from None
    if not summary_path.exists():
        tail = (finished.stdout or "").strip().splitlines()[-5:]
        raise FlowerError(f"the Flower run ended (flwr exit code {finished.returncode}) without a summary; "
                          f"logs in {work_dir}; last lines: {' | '.join(tail)}")
    return json.loads(summary_path.read_text())
