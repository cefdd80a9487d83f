"""stoker.rollback's pieces: the spike detector, the sampler that skips quarantined rows, the rows of a window."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from stoker.packing import pack_rows
from stoker.rollback import QuarantineSampler, SpikeDetected, SpikeDetector, Window, install_quarantine
from stoker.step import Layout


def test_a_spike_is_a_loss_above_the_factor_times_the_median_once_the_window_is_full():
    detector = SpikeDetector(factor=3.0, window=3)
    for step, loss in enumerate((10.0, 1.0, 2.0), 1):  # warm-up: even 10 x the others is accepted
        detector.check(step, loss, True)
    assert detector.median() == 2.0
    detector.check(4, 5.9, True)  # under 3 x 2.0
    assert list(detector.losses) == [1.0, 2.0, 5.9] and detector.median() == 2.0
    with pytest.raises(SpikeDetected) as spike:
        detector.check(5, 6.1, True)
    assert (spike.value.step, spike.value.loss, spike.value.median, spike.value.reason) == (5, 6.1, 2.0, "loss spike")
    assert list(detector.losses) == [1.0, 2.0, 5.9]  # a spike never enters the median
    with pytest.raises(SpikeDetected, match="non-finite"):
        SpikeDetector(3.0, 3).check(1, math.nan, True)  # non-finite: a spike even in the warm-up
    with pytest.raises(SpikeDetected, match="non-finite"):
        SpikeDetector(3.0, 3).check(1, 1.0, False)  # a non-finite gradient norm on some process


def test_the_quarantine_sampler_keeps_the_order_without_the_rows_and_records_it_per_epoch():
    quarantined = {2, 5}
    sampler = QuarantineSampler(SequentialSampler(range(8)), quarantined)
    loader = DataLoader(list(range(8)), batch_size=3, sampler=sampler)
    assert [b.tolist() for b in loader] == [[0, 1, 3], [4, 6, 7]] and len(loader) == 2
    assert sampler.orders == {0: [0, 1, 3, 4, 6, 7]}
    quarantined.add(0)  # the set is shared: the next epoch skips the row added now
    sampler.set_epoch(1)
    assert list(sampler) == [1, 3, 4, 6, 7] and sampler.orders[1] == [1, 3, 4, 6, 7]


def test_the_filter_goes_under_accelerates_wrappers_once():
    from accelerate import Accelerator

    loader = Accelerator(cpu=True).prepare(DataLoader(list(range(6)), batch_size=2))
    rows = {1}
    first = install_quarantine(loader, rows)
    assert isinstance(first, QuarantineSampler) and install_quarantine(loader, rows) is first
    assert [b.tolist() for b in loader] == [[0, 2], [3, 4], [5]]
    assert install_quarantine(DataLoader(torch.utils.data.TensorDataset(torch.zeros(2)), batch_sampler=BatchSampler(
        SequentialSampler(range(2)), 1, False)), set()) is not None
    assert install_quarantine([1, 2, 3], set()) is None  # no index sampler to filter


@pytest.mark.parametrize("split, expected", [(False, [0, 0, 1, 1, 0, 0, 1, 1]), (True, [0, 1, 0, 1, 0, 1, 0, 1])])
def test_a_windows_rows_are_dealt_to_the_processes_as_accelerate_deals_them(split, expected):
    window = Window(step=3, epoch=0, start=16, stop=24, layout=Layout(2, 2, 2, split_batches=split))
    assert [window.rank_of(p) for p in range(window.start, window.stop)] == expected


def test_packed_rows_name_the_rows_packed_into_them():
    rows = [{"input_ids": list(range(1, n + 1))} for n in (5, 3, 0, 4, 2)]
    packed = pack_rows(rows, max_length=8)
    assert len(packed.sources) == len(packed)
    assert sorted(i for s in packed.sources for i in s) == [0, 1, 3, 4]  # the empty row 2 trains nothing
    for row, sources in zip(packed, packed.sources, strict=True):
        assert len(row["input_ids"]) == sum(len(rows[i]["input_ids"]) for i in sources)
