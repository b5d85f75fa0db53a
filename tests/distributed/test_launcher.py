"""``kiln run``'s decisions, without starting workers: core and device splits, torchrun's
command line, and the errors for bad input."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kiln.distributed import launch
from kiln.distributed.grad_sync import make_buckets
from kiln.distributed.topology import (
    TopologyError,
    format_list,
    parse_list,
    split_cpus,
    split_devices,
    worker_device_env,
)
from kiln.tools.cli import main as kiln_cli


def test_parse_and_format_lists():
    assert parse_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert parse_list("") == []
    for bad in ("a", "3-1", "0,0", "-1"):
        with pytest.raises(TopologyError):
            parse_list(bad)


def test_cpu_split_is_disjoint_and_covers_every_core():
    assert split_cpus([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert split_cpus(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_cpus([4, 5], 1) == [[4, 5]]
    # more workers than cores: shared cores, one each (the launcher warns)
    assert split_cpus([0, 1], 4) == [[0], [1], [0], [1]]
    with pytest.raises(TopologyError):
        split_cpus([0, 1], 0)


def test_device_split_per_worker():
    env = {"NEURON_RT_VISIBLE_CORES": "0-31", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert worker_device_env(env, 0, 2) == {
        "NEURON_RT_VISIBLE_CORES": "0-15",
        "CUDA_VISIBLE_DEVICES": "2",
    }
    assert worker_device_env(env, 1, 2) == {
        "NEURON_RT_VISIBLE_CORES": "16-31",
        "CUDA_VISIBLE_DEVICES": "3",
    }
    assert worker_device_env({}, 0, 2) == {}
    with pytest.raises(TopologyError, match="cannot be split evenly"):
        split_devices([0, 1, 2], 2)


def test_torchrun_command_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    one = launch.LaunchSpec(str(script), ["--lr", "1"], nproc_per_node=2, cpu_list="0")
    argv = launch.torchrun_argv(one)
    assert "--nproc-per-node=2" in argv and "--rdzv-backend=c10d" in argv
    assert "--rdzv-endpoint=localhost:0" in argv and "--max-restarts=0" in argv
    i = argv.index("-m")
    assert argv[i + 1] == "kiln.distributed.worker" and "--cpus=0" in argv
    assert argv[-4:] == [str(script), "--", "--lr", "1"]
    multi = launch.LaunchSpec(
        str(script), nproc_per_node=2, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400"
    )
    argv = launch.torchrun_argv(multi)
    assert "--nnodes=2" in argv and "--node-rank=1" in argv
    assert "--rdzv-endpoint=10.0.0.1:29400" in argv and "--rdzv-id=kiln" in argv
    # torchrun itself accepts the command line
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(argv)
    assert (
        ns.nproc_per_node == "2" and ns.module and ns.training_script == "kiln.distributed.worker"
    )


def test_bad_input_is_a_clear_error(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    cases = [
        ({"script": str(tmp_path / "missing.py")}, "not found"),
        ({"script": str(script), "nproc_per_node": 0}, "--nproc-per-node"),
        ({"script": str(script), "nnodes": 2}, "--rdzv-endpoint"),
        (
            {"script": str(script), "nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"},
            "--node-rank",
        ),
    ]
    for kw, msg in cases:
        with pytest.raises(launch.LaunchError, match=msg):
            launch.validate(launch.LaunchSpec(**kw))
    with pytest.raises(launch.LaunchError, match="may not use"):
        launch.LaunchSpec(str(script), cpu_list="100000").cpus()
    r = CliRunner().invoke(kiln_cli, ["run", "--nproc-per-node", "2", str(tmp_path / "nope.py")])
    assert r.exit_code != 0 and "not found" in r.output


def test_gradient_buckets():
    import torch

    ps = [torch.zeros(100), torch.zeros(300), torch.zeros(50, dtype=torch.float64), torch.zeros(10)]
    # reverse order; a dtype change or the cap closes a bucket; an oversized tensor stands alone
    assert make_buckets(ps, 1600) == [[3], [2], [1, 0]]
    assert make_buckets(ps, 800) == [[3], [2], [1], [0]]
    assert sorted(i for b in make_buckets(ps, 10**9) for i in b) == [0, 1, 2, 3]


def test_a_failure_report_names_the_failed_rank_first(tmp_path):
    """A worker that exits without raising (``os._exit(3)``) was reported with torchrun's
    placeholder ("To enable traceback see: ...errors.html"), and the rank ``kiln run`` stopped
    afterwards as "killed by signal SIGTERM" beside its lost-connection error, listed first."""
    import json
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "e0.json"
    error_file.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: Connection reset by peer",
                    "extraInfo": {"timestamp": "0"},
                }
            }
        )
    )
    stopped = ProcessFailure(0, 11, -signal.SIGTERM, str(error_file))
    failed = ProcessFailure(1, 12, 3, "<N/A>")
    lines = launch.describe_failure(ChildFailedError("w", {0: stopped, 1: failed})).splitlines()
    assert lines[1].startswith("  rank 1 (local rank 1, pid 12): exit code 3: no Python error")
    assert "errors.html" not in lines[1]
    assert lines[2].startswith("  rank 0 (local rank 0, pid 11): stopped by kiln run (SIGTERM)")
    assert lines[2].endswith("RuntimeError: Connection reset by peer")
