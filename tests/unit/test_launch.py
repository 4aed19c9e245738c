"""`eagle3-train launch`: the per-machine torchrun command (integration/test_train.py runs it as two loopback
"nodes")."""

import shlex

import pytest

from eagle3_train.cli import main as cli_main
from eagle3_train.launch import LaunchSettings, node_command
from eagle3_train.utils.io import Eagle3InputError


def test_prints_one_command_that_every_machine_runs(capsys):
    rc = cli_main(["launch", "--nodes", "2", "--gpus-per-node", "8", "--head", "10.0.0.1", "--", "train",
                   "--prepared", "/shared/prep", "--out", "/shared/train"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    cmd = shlex.split(lines[-1])
    assert cmd[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"]
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "10.0.0.1:29500"
    assert cmd[cmd.index("-m") + 1:] == ["eagle3_train.cli", "train", "--prepared", "/shared/prep", "--out",
                                         "/shared/train"]
    # the rendezvous id follows the arguments: the same on every machine, another for another run
    same = node_command(LaunchSettings(2, 8, "10.0.0.1", ["train", "--prepared", "/shared/prep", "--out",
                                                          "/shared/train"]))
    other = node_command(LaunchSettings(2, 8, "10.0.0.1", ["train", "--out", "/shared/other"]))
    rid = cmd.index("--rdzv-id") + 1
    assert same[rid] == cmd[rid] != other[rid]


@pytest.mark.parametrize("argv,match", [
    (["--nodes", "0", "--gpus-per-node", "8", "--head", "h", "--", "train"], "at least 1"),
    (["--nodes", "2", "--gpus-per-node", "8", "--head", ":29500", "--", "train"], "--head"),
    (["--nodes", "2", "--gpus-per-node", "8", "--head", "h", "--", "export", "--out", "x"], "train, extract"),
    (["--nodes", "2", "--gpus-per-node", "8", "--head", "h"], "got nothing"),
])
def test_bad_input_is_named(argv, match, capsys):
    assert cli_main(["launch", *argv]) == 2
    assert match in capsys.readouterr().err
    with pytest.raises(Eagle3InputError, match="launch"):
        node_command(LaunchSettings(0, 1, "h", ["train"]))
