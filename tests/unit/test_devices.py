"""Which GPUs a trial's process sees and which is its own (service/distributed/devices.py),
against hand-worked layouts."""

from __future__ import annotations

import pytest

from service.distributed.devices import gpu_index, shared_gpus


def test_the_ranks_on_a_node_see_all_of_the_trials_gpus_there_in_id_order():
    placements = [("A", ["2"]), ("A", ["10"]), ("B", ["1"]), ("A", ["0"]), ("B", ["3"])]
    assert shared_gpus(placements) == ["0,2,10", "0,2,10", "1,3", "0,2,10", "1,3"]


def test_a_rank_alone_on_its_node_sees_only_its_gpu():
    assert shared_gpus([("A", ["5"]), ("B", ["0"])]) == ["5", "0"]


def test_each_rank_uses_its_own_gpu_by_its_place_among_those_it_sees():
    assert [gpu_index("0,2,10", [g]) for g in ("0", "2", "10")] == [0, 1, 2]
    assert gpu_index("7", [7]) == 0  # what Ray sets for a process alone: its one GPU
    assert gpu_index(None, ["3"]) == 3  # nothing masks the GPUs: the index is the id
    assert gpu_index("", [1]) == 1


def test_a_gpu_the_process_does_not_see_or_not_exactly_one_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES=0,2 does not include this process's GPU 5"):
        gpu_index("0,2", ["5"])
    with pytest.raises(RuntimeError, match="holds one GPU; Ray gave this one 2"):
        gpu_index("0,1", ["0", "1"])
    with pytest.raises(RuntimeError, match="holds one GPU; Ray gave this one 0"):
        gpu_index("0", [])
