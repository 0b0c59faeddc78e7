"""A long-running ClientApp process for one SuperNode: a site builds its data and model once per run.

Flower 1.41 runs a ClientApp in a process that handles one message and exits: with the
SuperNode's ``--isolation subprocess`` its ``flower-superexec`` starts a ``flwr-clientapp``
process for every message, which imports torch and builds the run before it trains (its
``--isolation process`` only moves that launcher out of the SuperNode; ``flwr-clientapp``
still takes one task token and exits). :func:`serve` is that launcher and the ClientApp in one
long-running process instead: beside a SuperNode started with ``--isolation process``, it takes
each of the SuperNode's tasks from its Runtime API (``AcquireTask``, as ``flower-superexec``
does) and runs FedBed's ClientApp (:data:`fedbed.flower.apps.client_app`) on the task's message
in this process, exactly as ``flwr-clientapp`` would (Flower's own ``pull_task_input``,
``push_message`` and ``push_task_output``, the task's heartbeat): the message, the node's
context (its ``partition-id``, the run config, the client state in ``context.state``) and the
reply are the same; only the process lives on, so the site's data and model, built on its first
message (:func:`fedbed.flower.apps.cached_run`), serve every later one.

``fedbed run --backend flower-deployment`` starts one beside each SuperNode and stops it with
it; a site of a real federation starts it with ``fedbed flower-clientapp --runtime-api-address
HOST:PORT`` (the SuperNode's ``--host`` / ``--port``). It runs FedBed's ClientApp only: a task
of another Flower App is answered with an error reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 0.1
"""How often the process asks its SuperNode for a task when it has none."""
CONNECT_TIMEOUT = 300.0
"""Seconds to wait for the SuperNode's Runtime API to answer at start-up."""
LOST_AFTER = 60.0
"""Seconds without an answer from the SuperNode, once it answered, after which the process ends
(its SuperNode stopped)."""
CLIENT_APP = "fedbed.flower.apps:client_app"
"""The ClientApp component this process runs (what :func:`fedbed.flower.deployment.write_app` writes)."""


def _runtime_client(address: str, component: str, token: str | None = None) -> Any:
    """A client of the SuperNode's Runtime API at ``address`` (plain HTTP on the site's own
    machine, as ``flower-superexec`` uses it), with Flower's retries when it carries a task's
    ``token``, without (the task poll handles a missing SuperNode itself) otherwise."""
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors = [RuntimeVersionHttpInterceptor(component_name=component)]
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                 interceptors=interceptors,
                                                 retry_invoker=make_simple_http_retry_invoker() if token else None)


def run_task(address: str, token: str, client_app: Any) -> str:
    """Run one task of the SuperNode at ``address`` (its ``token`` from ``AcquireTask``) with
    ``client_app`` in this process, as Flower's ``flwr-clientapp`` runs it: pull the message and
    the node's context, call the ClientApp, push its reply (an error reply when it raised or the
    task belongs to another Flower App) and the context back; return the task's status
    (``completed`` or ``failed``: Flower's ``SubStatus``)."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.config import get_fab_config
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    client = _runtime_client(address, "flwr-clientapp", token)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "the ClientApp process failed before it read the task"
    try:
        message, context, _, fab = pull_task_input(client)
        component = get_fab_config(fab.content)["tool"]["flwr"]["app"]["components"]["clientapp"]
        if component != CLIENT_APP:
            raise RuntimeError(f"this SuperNode's ClientApp process runs FedBed's ClientApp ({CLIENT_APP}) only, not "
                               f"{component}: start the SuperNode with --isolation subprocess for other Flower Apps")
        reply = client_app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except (Exception, KeyboardInterrupt) as error:  # Flower's heartbeat interrupts a task the SuperNode dropped
        details = f"{type(error)}:<'{error}'>"  # as flwr-clientapp words it
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client, context, status, details)
        finally:
            heartbeat.stop()
            client.close()
    return status


def serve(address: str, echo: Callable[..., Any] = print, poll_seconds: float = POLL_SECONDS,
          connect_timeout: float = CONNECT_TIMEOUT, lost_after: float = LOST_AFTER) -> None:
    """Take every ClientApp task of the SuperNode whose Runtime API listens at ``address``
    (``HOST:PORT``) and run it in this process (:func:`run_task`), until the SuperNode has not
    answered for ``lost_after`` seconds (it stopped), SIGTERM or Ctrl-C. A task that fails,
    or that Flower's heartbeat interrupts when the SuperNode drops it, is reported to the
    SuperNode by :func:`run_task`; a failure to report it is one line here, and the next task is
    served.

    Raises:
        fedbed.flower.common.FlowerError: the SuperNode's Runtime API did not answer within
            ``connect_timeout`` seconds of the start.
    """
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType

    from fedbed.federation import phase_timings
    from fedbed.flower.apps import client_app
    from fedbed.flower.common import FlowerError

    phase_timings.record_process_start("client")
    control = _runtime_client(address, "SuperExec")
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
    began, answered_at, tasks = time.monotonic(), None, 0
    try:
        while True:
            try:
                acquired = control.AcquireTask(request)
            except httpx.TransportError:
                now = time.monotonic()
                if answered_at is None and now - began > connect_timeout:
                    raise FlowerError(f"the SuperNode's Runtime API at {address} did not answer within "
                                      f"{connect_timeout:g} s; start it with --isolation process --port PORT") from None
                if answered_at is not None and now - answered_at > lost_after:
                    echo(f"flower-clientapp: the SuperNode at {address} has not answered for {lost_after:g} s; "
                         f"stopping after {tasks} task(s)")
                    return
                time.sleep(poll_seconds)
                continue
            answered_at = time.monotonic()
            if acquired.HasField("task") and acquired.token:
                try:
                    run_task(address, acquired.token, client_app)
                except Exception as error:  # noqa: BLE001  (a KeyboardInterrupt, SIGTERM's too, stops the process)
                    # Reporting the task failed (the Runtime API refused the reply): that task is
                    # lost, as under Flower's per-message processes; the site serves the next one.
                    echo(f"flower-clientapp: a task ended without its result reaching the SuperNode "
                         f"({type(error).__name__}: {error}); serving the next")
                tasks += 1
            else:
                time.sleep(poll_seconds)
    finally:
        control.close()
