"""The step-time model of granular offload (`hf_p2r.distributed.offload.step_time`): its arithmetic on cases small
enough to follow by hand, and the direction of each design's effect."""

import pytest

from hf_p2r.distributed.offload.step_time import (
    DESIGNS,
    Design,
    HostRates,
    OffloadStep,
    predict_step_seconds,
    spread_layers,
)

GB = 1e9
# A host where each phase is easy to count: 1e9 updates/s, 10 GB/s for the rest.
RATES = HostRates(1e9, 10 * GB, 10 * GB, 10 * GB)


def predict(design: Design, compute=1.0, n=1_000_000_000, m=4, k=4, blocks=8, h2d=100 * GB, d2h=100 * GB):
    return predict_step_seconds(compute, OffloadStep(n, m, k, blocks), design, RATES, h2d, d2h)


def test_no_offload_costs_nothing():
    step = predict_step_seconds(0.5, OffloadStep(0, 8, 0, 16), Design(), RATES, GB, GB)
    assert step.seconds == 0.5 and step.vs_no_offload == 1.0 and not step.parts


def test_the_bus_costs_only_what_exceeds_the_compute():
    # 4 micro-batches x (2 reads - the last block's shared copy: 2 - 1/4) x 1e9 parameters x 2 bytes = 14 GB.
    fast = predict(Design(grad_accumulation="device", update="delayed"), h2d=100 * GB)
    assert fast.bus["to_device"] == pytest.approx(14e9) and fast.parts["bus"] == 0.0
    slow = predict(Design(grad_accumulation="device", update="delayed"), h2d=7 * GB)
    assert slow.parts["bus"] == pytest.approx(14 / 7 - 1.0)


def test_host_sums_are_counted_and_exposed_beyond_each_backward():
    step = predict(Design())
    # First part: 1e9 x 4 bytes converted at 10 GB/s = 0.4 s; each later one: 8 bytes summed + 4 read for the norm
    # at 10 GB/s = 1.2 s; 3 later ones.
    assert step.host_work["accumulate"] == pytest.approx(0.4 + 3 * 1.2)
    assert step.bus["to_host"] == pytest.approx(4 * 1e9 * 2)
    assert step.parts["accumulate"] > 0  # a micro-batch's backward is 1/6 s: far less than the host's sums


def test_device_sums_replace_the_host_work_by_one_copy():
    host, device = predict(Design()), predict(Design(grad_accumulation="device"))
    assert "accumulate" not in device.host_work and device.bus["to_host"] == pytest.approx(4e9)
    assert device.seconds < host.seconds


def test_the_update_is_hidden_more_the_later_it_may_finish():
    after, during, delayed = (
        predict(Design(grad_accumulation="device", update=update))
        for update in ("after_backward", "during_backward", "delayed")
    )
    # 1e9 updates at 1e9/s plus 2 GB of copies at 10 GB/s: 1.2 s of host work, whatever the design.
    assert after.host_work["update"] == during.host_work["update"] == delayed.host_work["update"] == pytest.approx(1.2)
    assert after.parts["update"] > during.parts["update"] > delayed.parts["update"] == pytest.approx(0.2)


def test_after_backward_waits_for_the_blocks_in_the_forwards_order():
    """4 blocks of 8 (1, 3, 5, 7), each update 0.3 s, a forward of 1/12 s: the forward reaches block 7 at
    (7.5/8)/12 s and waits for the four updates (1.2 s): exposed 1.2 - 7.5/96."""
    assert spread_layers(4, 8) == [1, 3, 5, 7]
    step = predict(Design(grad_accumulation="device"))
    assert step.parts["update"] == pytest.approx(1.2 - 7.5 / 96)


def test_device_chunked_moves_the_state_over_the_bus_and_no_host_work():
    step = predict(Design(grad_accumulation="device", optimizer_step="device_chunked"), h2d=10 * GB, d2h=10 * GB)
    assert "update" not in step.host_work
    assert step.parts["device_chunked step"] == pytest.approx(1e9 * 16 / 10e9 + 1e9 * 14 / 10e9)


def test_every_named_design_predicts():
    for name, design in DESIGNS.items():
        step = predict(design)
        assert step.seconds >= 1.0 and 0 < step.vs_no_offload <= 1.0, name
