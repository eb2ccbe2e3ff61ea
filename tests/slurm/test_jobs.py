"""The helpers that read the tests' multi-node job logs."""

from tests.slurm.jobs import attempts, node_logs


def test_node_logs_keep_a_line_whole_when_srun_cuts_it_and_the_other_node_prints_in_between() -> None:
    log = (
        "1: [default0]:Slurm job 7: attempt 1 on node1\n"
        "0: [default0]:Slurm job 7: attempt 1 on node0\n"
        "0: [default0]:[rank0]: RuntimeError: Timed out wai\n"
        "1: [default0]:[rank1]: Connection closed by peer\n"
        "0: ting 20000ms for recv operation to complete\n"
        "0: [default0]:Slurm job 7: attempt 2 on node0\n"
    )
    logs = node_logs(log)
    assert logs.keys() == {0, 1}
    assert attempts(logs[0], "7").keys() == {1, 2}
    first, second = attempts(logs[0], "7").values()
    assert "Timed out waiting 20000ms" in first and "Connection closed" not in first
    assert second == "Slurm job 7: attempt 2 on node0\n"
    assert attempts(logs[1], "7") == {1: logs[1]}


def test_attempts_of_a_node_may_skip_one_that_left_no_line() -> None:
    log = "torchrun starts\nSlurm job 7: attempt 1 on node0\nfailed\nSlurm job 7: attempt 3 on node0\ndone\n"
    assert attempts(log, "7") == {
        1: "torchrun starts\nSlurm job 7: attempt 1 on node0\nfailed\n",
        3: "Slurm job 7: attempt 3 on node0\ndone\n",
    }
