"""``kiln cluster``: run the scheduler server/agent and call its API from the shell.

    kiln cluster serve [--port 8080]                     # API + embedded agent on 127.0.0.1
    kiln cluster add-instance --type trn1.32xlarge --simulated
    kiln cluster register-task-definition --file td.json
    kiln cluster run-task --task-definition train
    kiln cluster describe-tasks TASK_ARN ; kiln cluster stop-task TASK_ARN

API commands talk to a server when given ``--endpoint``, otherwise directly to the store
(``--store``, default ``~/.kiln/cluster.db``; a ``postgresql://`` DSN selects PostgreSQL).
Output is the API's JSON.  (There are no ``KILN_CLUSTER_*`` environment variables: Kiln's config
rejects unknown ``KILN_*`` names.)
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import signal
import sqlite3
import sys
import threading
import urllib.error
import urllib.request
from typing import Any

import click

from kiln.cluster.errors import ECSError

TARGET_PREFIX = "AmazonEC2ContainerServiceV20141113."
# What the scheduler imports beyond Kiln's base install (the ``cluster`` extra).
CLUSTER_MODULES = ("botocore", "re2")


def default_work_dir(store_url: str) -> str:
    """Where an agent keeps task directories (pid/exit files and captured output)."""
    if store_url.startswith(("postgresql://", "postgres://")):
        return os.path.join(os.path.expanduser("~"), ".kiln", "cluster-agent")
    path = store_url.removeprefix("sqlite:///").removeprefix("sqlite://")
    return os.path.abspath(path) + ".agent"


def _store_url(ctx: click.Context) -> str:
    from kiln.cluster.store import default_path

    return ctx.obj.get("store") or default_path()


def _service(ctx: click.Context) -> Any:
    from kiln.cluster.service import ClusterService
    from kiln.cluster.store import Store, StoreDamaged

    if "service" not in ctx.obj:
        url = _store_url(ctx)
        try:
            ctx.obj["service"] = ClusterService(Store(url))
        except StoreDamaged as e:
            raise click.ClickException(str(e)) from e
        except Exception as e:
            if not isinstance(e, (OSError, sqlite3.Error)) and not _is_psycopg_error(e):
                raise
            raise click.ClickException(
                f"cannot open the cluster store {_redact(url)} ({' '.join(str(e).split())});"
                " fix --store (a SQLite file path or a reachable postgresql:// DSN)"
            ) from e
    return ctx.obj["service"]


def _is_psycopg_error(e: BaseException) -> bool:
    """True for PostgreSQL driver errors (psycopg is optional, so it is not imported here)."""
    return type(e).__module__.split(".")[0] == "psycopg"


def _redact(url: str) -> str:
    """``url`` with any password in a DSN replaced by ``***``."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def call(ctx: click.Context, action: str, body: dict[str, Any]) -> dict[str, Any]:
    """Run one API action against the endpoint or the store; errors exit with status 1 and a
    one-line message (never a traceback)."""
    endpoint = ctx.obj.get("endpoint")
    try:
        if not endpoint:
            return _service(ctx).call(action, body)
        return _post(endpoint, action, body, ctx.obj.get("token"))
    except ECSError as e:
        raise click.ClickException(f"{e.code}: {e.message}") from e


def _post(endpoint: str, action: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
    """POST one action to a server; an HTTP error, an unreachable or malformed URL and a reply
    that is not the API's JSON each raise a ``ClickException`` that names the URL."""
    url = endpoint.rstrip("/") + "/"
    headers = {
        "X-Amz-Target": TARGET_PREFIX + action,
        "Content-Type": "application/x-amz-json-1.1",
    }
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            return _reply_json(url, resp.read())
    except urllib.error.HTTPError as e:
        doc = _reply_json(url, e.read(), status=e.code)
        raise click.ClickException(f"{doc.get('__type')}: {doc.get('message')}") from e
    except urllib.error.URLError as e:
        raise click.ClickException(
            f"cannot reach the cluster server at {url} ({e.reason}); start one with"
            " `kiln cluster serve` or fix --endpoint"
        ) from e
    except (OSError, http.client.HTTPException) as e:  # timeouts, resets, garbled replies
        raise click.ClickException(
            f"the cluster server at {url} did not answer ({e or type(e).__name__}); check that"
            " `kiln cluster serve` is running there"
        ) from e
    except ValueError as e:  # a URL without a scheme or host
        raise click.ClickException(
            f"--endpoint {endpoint!r} is not a URL ({e}); give e.g. http://127.0.0.1:8080"
        ) from e


def _reply_json(url: str, raw: bytes, status: int | None = None) -> dict[str, Any]:
    """The server's JSON object reply; a ``ClickException`` if it is anything else."""
    try:
        doc = json.loads(raw or b"{}")
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        where = f" (HTTP {status})" if status is not None else ""
        raise click.ClickException(
            f"{url} answered{where} with something other than the cluster API's JSON;"
            " is --endpoint a `kiln cluster serve` server?"
        )
    return doc


def _emit(doc: dict[str, Any]) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True, default=str))


@click.group()
@click.option("--endpoint", help="Server URL, e.g. http://127.0.0.1:8080 (else the store).")
@click.option("--store", help="SQLite path or postgresql:// DSN [~/.kiln/cluster.db].")
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False),
    help="File holding the bearer token (sent by clients; accepted by serve). Never on the"
    " command line.",
)
@click.option("--cluster", "cluster_name", default="default", show_default=True)
@click.pass_context
def cluster(
    ctx: click.Context,
    endpoint: str | None,
    store: str | None,
    token_file: str | None,
    cluster_name: str,
) -> None:
    """Schedule tasks on accelerator instances (an ECS-compatible control plane)."""
    missing = [m for m in CLUSTER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(
            f"kiln cluster needs {', '.join(missing)}, which the cluster extra installs:"
            " pip install 'kiln[cluster]'"
        )
    ctx.ensure_object(dict)
    token = _read_secret_file(token_file) if token_file else None
    ctx.obj.update(endpoint=endpoint, store=store, token=token, cluster=cluster_name)


def _read_secret_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"cannot read {path}: {e}") from e
    if not value:
        raise click.ClickException(f"{path} is empty; put the secret on its first line")
    return value


def _read_credentials(path: str) -> dict[str, str]:
    """A JSON object {access key id: secret access key}."""
    try:
        with open(path) as f:
            creds = json.load(f)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"cannot read credentials from {path}: {e}") from e
    if (
        not isinstance(creds, dict)
        or not creds
        or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in creds.items())
    ):
        raise click.ClickException(
            f'{path} must hold a JSON object {{"ACCESS_KEY_ID": "SECRET_ACCESS_KEY"}}'
        )
    return creds


@cluster.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int, help="0 picks a free port.")
@click.option("--agent/--no-agent", default=True, help="Run containers of this store's instances.")
@click.option("--work-dir", help="Agent task directories (default: next to the store).")
@click.option(
    "--credentials-file",
    type=click.Path(exists=True, dir_okay=False),
    help='JSON {"ACCESS_KEY_ID": "SECRET"}: SigV4 credentials clients must sign with.',
)
@click.option(
    "--secrets-file",
    type=click.Path(exists=True, dir_okay=False),
    help="JSON {valueFrom: value}: where tasks' `secrets` come from.",
)
@click.pass_context
def serve(
    ctx: click.Context,
    host: str,
    port: int,
    agent: bool,
    work_dir: str | None,
    credentials_file: str | None,
    secrets_file: str | None,
) -> None:
    """Serve the ECS JSON API (loopback only unless authentication is configured)."""
    from kiln.cluster.agent import Agent
    from kiln.cluster.server import ClusterHTTPServer

    service = _service(ctx)
    creds = _read_credentials(credentials_file) if credentials_file else None
    try:
        server = ClusterHTTPServer(
            host, port, service, token=ctx.obj.get("token"), credentials=creds
        )
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    runner = None
    if agent:
        runner = Agent(
            service, work_dir or default_work_dir(_store_url(ctx)), secrets_file=secrets_file
        )
        runner.start()
    click.echo(f"kiln cluster listening on {server.url}", nl=True)
    sys.stdout.flush()
    stop = threading.Event()
    threading.Thread(
        target=_janitor, args=(service, stop), name="kiln-janitor", daemon=True
    ).start()

    def _shutdown(signum: int, frame: Any) -> None:
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _shutdown)
    signal.signal(signal.SIGINT, _shutdown)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        if runner is not None:
            runner.stop()
        server.server_close()


def _janitor(service: Any, stop: threading.Event, every: float = 2.0) -> None:
    """Server-side upkeep: stop unclaimed tasks of instances whose agent went quiet; keep every
    service at its desiredCount."""
    import logging

    while not stop.wait(every):
        try:
            service.reap_disconnected()
            service.reconcile_services()
        except Exception:  # the store is unreachable for now: retry on the next tick
            logging.getLogger(__name__).exception("cluster upkeep failed")


@cluster.command("agent")
@click.option("--instance", "instances", multiple=True, help="Container instance ARN (repeat).")
@click.option("--work-dir", help="Task directories (default: next to the store).")
@click.option(
    "--secrets-file",
    type=click.Path(exists=True, dir_okay=False),
    help="JSON {valueFrom: value}: where tasks' `secrets` come from.",
)
@click.pass_context
def agent_cmd(
    ctx: click.Context, instances: tuple[str, ...], work_dir: str | None, secrets_file: str | None
) -> None:
    """Run the agent alone (against a shared store) until interrupted."""
    from kiln.cluster.agent import Agent

    runner = Agent(
        _service(ctx),
        work_dir or default_work_dir(_store_url(ctx)),
        list(instances) or None,
        secrets_file=secrets_file,
    )
    signal.signal(signal.SIGTERM, lambda *_: runner._stop.set())
    try:
        runner.run()
    except KeyboardInterrupt:
        pass


@cluster.command("register-task-definition")
@click.option("--file", "path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.pass_context
def register_task_definition(ctx: click.Context, path: str) -> None:
    """Register a task definition from a JSON file (the RegisterTaskDefinition body)."""
    _emit(call(ctx, "RegisterTaskDefinition", _read_json_object(path)))


def _read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in ``path``; a ``ClickException`` naming the file (and the position of a
    syntax error) if it cannot be read or is not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise click.ClickException(
            f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno};"
            " fix the file and run the command again"
        ) from e
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"cannot read {path}: {e}") from e
    if not isinstance(doc, dict):
        raise click.ClickException(
            f"{path} must hold a JSON object (the RegisterTaskDefinition request body),"
            f" not a {type(doc).__name__}"
        )
    return doc


@cluster.command("describe-task-definition")
@click.argument("task_definition")
@click.pass_context
def describe_task_definition(ctx: click.Context, task_definition: str) -> None:
    _emit(call(ctx, "DescribeTaskDefinition", {"taskDefinition": task_definition}))


@cluster.command("list-task-definitions")
@click.option("--family-prefix")
@click.pass_context
def list_task_definitions(ctx: click.Context, family_prefix: str | None) -> None:
    body = {"familyPrefix": family_prefix} if family_prefix else {}
    _emit(call(ctx, "ListTaskDefinitions", body))


@cluster.command("deregister-task-definition")
@click.argument("task_definition")
@click.pass_context
def deregister_task_definition(ctx: click.Context, task_definition: str) -> None:
    _emit(call(ctx, "DeregisterTaskDefinition", {"taskDefinition": task_definition}))


@cluster.command("create-cluster")
@click.argument("name", default="default")
@click.pass_context
def create_cluster(ctx: click.Context, name: str) -> None:
    _emit(call(ctx, "CreateCluster", {"clusterName": name}))


@cluster.command("describe-clusters")
@click.argument("names", nargs=-1)
@click.pass_context
def describe_clusters(ctx: click.Context, names: tuple[str, ...]) -> None:
    _emit(call(ctx, "DescribeClusters", {"clusters": list(names) or [ctx.obj["cluster"]]}))


@cluster.command("add-instance")
@click.option("--type", "itype", required=True, help="Catalog instance type, e.g. trn1.32xlarge.")
@click.option("--simulated", is_flag=True, help="Devices from the catalog, no device files.")
@click.option("--device-root", type=click.Path(file_okay=False), help="Discover devices here.")
@click.option("--attribute", "attributes", multiple=True, help="NAME=VALUE (repeat).")
@click.pass_context
def add_instance(
    ctx: click.Context,
    itype: str,
    simulated: bool,
    device_root: str | None,
    attributes: tuple[str, ...],
) -> None:
    """Register this machine (or a simulated one) as a container instance (Kiln extension).

    Without --simulated the host's devices are discovered (under --device-root if given);
    with --simulated they come from the catalog, and --device-root, if given, is where the agent
    checks their device files.
    """
    from kiln.devices import discovery

    attrs = [{"name": "ecs.instance-type", "value": itype}]
    for a in attributes:
        name, _, value = a.partition("=")
        attrs.append({"name": name, "value": value})
    body: dict[str, Any] = {"cluster": ctx.obj["cluster"], "attributes": attrs}
    if device_root:
        attrs.append({"name": "kiln.device-root", "value": os.path.abspath(device_root)})
    if simulated:
        body["kilnSimulated"] = True
    else:
        found = discovery.discover(device_root or "/")
        if not found:
            raise click.ClickException(
                "no devices found on this host; use --simulated or --device-root DIR"
            )
        body["kilnSimulated"] = False
        body["kilnDevices"] = [
            {
                "kind": d.kind,
                "index": d.index,
                "path": d.path,
                "cores": d.cores,
                "memoryMib": d.memory_mib,
                "name": d.name,
                "uuid": d.uuid,
            }
            for d in found
        ]
    _emit(call(ctx, "RegisterContainerInstance", body))


@cluster.command("describe-container-instances")
@click.argument("instances", nargs=-1, required=True)
@click.pass_context
def describe_container_instances(ctx: click.Context, instances: tuple[str, ...]) -> None:
    body = {"cluster": ctx.obj["cluster"], "containerInstances": list(instances)}
    _emit(call(ctx, "DescribeContainerInstances", body))


@cluster.command("list-container-instances")
@click.option("--filter", "expr", help="Cluster query language expression.")
@click.pass_context
def list_container_instances(ctx: click.Context, expr: str | None) -> None:
    body: dict[str, Any] = {"cluster": ctx.obj["cluster"]}
    if expr:
        body["filter"] = expr
    _emit(call(ctx, "ListContainerInstances", body))


@cluster.command("update-container-instances-state")
@click.argument("instances", nargs=-1, required=True)
@click.option("--status", type=click.Choice(["ACTIVE", "DRAINING"]), required=True)
@click.pass_context
def update_state(ctx: click.Context, instances: tuple[str, ...], status: str) -> None:
    body = {"cluster": ctx.obj["cluster"], "containerInstances": list(instances), "status": status}
    _emit(call(ctx, "UpdateContainerInstancesState", body))


@cluster.command("run-task")
@click.option("--task-definition", required=True)
@click.option("--count", default=1, show_default=True, type=int)
@click.option("--group")
@click.option("--member-of", "member_of", multiple=True, help="memberOf expression (repeat).")
@click.option("--distinct-instance", is_flag=True)
@click.option(
    "--strategy", "strategies", multiple=True, help="binpack:cpu, spread:instanceId, random"
)
@click.pass_context
def run_task(
    ctx: click.Context,
    task_definition: str,
    count: int,
    group: str | None,
    member_of: tuple[str, ...],
    distinct_instance: bool,
    strategies: tuple[str, ...],
) -> None:
    body: dict[str, Any] = {
        "cluster": ctx.obj["cluster"],
        "taskDefinition": task_definition,
        "count": count,
    }
    if group:
        body["group"] = group
    cons: list[dict[str, str]] = [{"type": "memberOf", "expression": e} for e in member_of]
    if distinct_instance:
        cons.append({"type": "distinctInstance"})
    if cons:
        body["placementConstraints"] = cons
    if strategies:
        body["placementStrategy"] = [
            {"type": s.partition(":")[0], **({"field": s.partition(":")[2]} if ":" in s else {})}
            for s in strategies
        ]
    _emit(call(ctx, "RunTask", body))


@cluster.command("describe-tasks")
@click.argument("tasks", nargs=-1, required=True)
@click.pass_context
def describe_tasks(ctx: click.Context, tasks: tuple[str, ...]) -> None:
    _emit(call(ctx, "DescribeTasks", {"cluster": ctx.obj["cluster"], "tasks": list(tasks)}))


@cluster.command("list-tasks")
@click.option("--desired-status", type=click.Choice(["RUNNING", "PENDING", "STOPPED"]))
@click.pass_context
def list_tasks(ctx: click.Context, desired_status: str | None) -> None:
    body: dict[str, Any] = {"cluster": ctx.obj["cluster"]}
    if desired_status:
        body["desiredStatus"] = desired_status
    _emit(call(ctx, "ListTasks", body))


@cluster.command("stop-task")
@click.argument("task")
@click.option("--reason")
@click.pass_context
def stop_task(ctx: click.Context, task: str, reason: str | None) -> None:
    body = {"cluster": ctx.obj["cluster"], "task": task}
    if reason:
        body["reason"] = reason
    _emit(call(ctx, "StopTask", body))


@cluster.command("logs")
@click.argument("task")
@click.option("--work-dir", help="The agent's work dir (default: next to the store).")
@click.option("--container", default=0, show_default=True, type=int, help="Container index.")
@click.pass_context
def logs(ctx: click.Context, task: str, work_dir: str | None, container: int) -> None:
    """Print a task's captured output (on the machine whose agent ran it)."""
    from kiln.cluster.agent import task_output

    try:
        text = task_output(work_dir or default_work_dir(_store_url(ctx)), task, container)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    except FileNotFoundError as e:
        raise click.ClickException(
            f"no output for task {task!r} container {container} under {e.filename};"
            " run this where the task's agent ran, or pass --work-dir"
        ) from e
    click.echo(text, nl=False)
