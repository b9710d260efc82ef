"""Metrics: the records of metrics.jsonl and the loss curve's delink markers (what is drawn, not the pixels)."""

import pytest

from hf_p2r.errors import InputError
from hf_p2r.training.metrics import (
    append_metrics,
    delink_points,
    draw_losses,
    read_metrics,
    stage_summary,
    truncate_metrics,
)

# Records as the trainer writes them: L=4, k=1, a partial delink to 2 blocks after step 2, to 4 (real) after step 4.
RECORDS = [
    {"step": 0, "stage": "pseudo", "num_blocks": 1, "val_loss": 5.6},
    {"step": 1, "stage": "pseudo", "num_blocks": 1, "loss": 5.5},
    {"step": 2, "stage": "pseudo", "num_blocks": 1, "loss": 5.3, "val_loss": 5.2},
    {"step": 2, "stage": "pseudo", "num_blocks": 2, "event": "delink", "num_blocks_before": 1},
    {"step": 3, "stage": "pseudo", "num_blocks": 2, "loss": 5.1},
    {"step": 4, "stage": "pseudo", "num_blocks": 2, "loss": 4.9, "val_loss": 4.8},
    {"step": 4, "stage": "real", "num_blocks": 4, "event": "delink", "num_blocks_before": 2},
    {"step": 5, "stage": "real", "num_blocks": 4, "loss": 4.6, "val_loss": 4.5},
]


def test_records_round_trip_and_truncate(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == []
    for record in RECORDS:
        append_metrics(path, record)
    assert read_metrics(path) == RECORDS
    truncate_metrics(path, 3)
    assert read_metrics(path) == RECORDS[:3]


def test_delink_points_are_the_delink_records():
    assert delink_points(RECORDS) == [(2, 2), (4, 4)]
    assert delink_points([r for r in RECORDS if "event" not in r]) == []  # from scratch: nothing to mark


def test_loss_curve_marks_each_delink_at_its_step():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots()
    try:
        draw_losses(axes, RECORDS, "run")
        curves = {line.get_label(): line for line in axes.lines if not line.get_label().startswith("_")}
        assert list(curves["training loss"].get_xdata()) == [1, 2, 3, 4, 5]
        assert list(curves["validation loss"].get_xdata()) == [0, 2, 4, 5]
        dashed = [line for line in axes.lines if line.get_linestyle() == "--"]
        assert [list(line.get_xdata()) for line in dashed] == [[2, 2], [4, 4]]  # vertical lines at the delink steps
        assert [(text.get_text(), text.xy[0]) for text in axes.texts] == [
            ("delink -> 2 blocks", 2),
            ("delink -> 4 blocks", 4),
        ]
    finally:
        plt.close(figure)


def test_a_damaged_record_is_one_line_naming_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2\n')
    with pytest.raises(InputError, match=r"metrics\.jsonl line 3: not valid JSON \("):
        read_metrics(path)
    path.write_text('{"step": 1}\n[1]\n')
    with pytest.raises(InputError, match=r"metrics\.jsonl line 2: expected a JSON object$"):
        read_metrics(path)


def test_stage_summary_gives_each_stage_its_last_validation_loss_and_its_throughput():
    # RECORDS with the step time: pseudo 1 s at 100 tokens/s, 3 s at 300, 1 s at 200, 1 s at 200; real 2 s at 50.
    timed = {1: (100.0, 1.0), 2: (300.0, 4.0), 3: (200.0, 5.0), 4: (200.0, 6.0), 5: (50.0, 8.0)}
    records = [
        {**r, "tokens_per_s": timed[r["step"]][0], "train_time_s": timed[r["step"]][1]} if "loss" in r else r
        for r in RECORDS
    ]
    pseudo, real = stage_summary(records)
    assert pseudo == {
        "stage": "pseudo",
        "steps": (0, 4),
        "blocks": [1, 2],
        "depths": [],  # (records without the depth: written before it was recorded)
        "val_loss": 4.8,
        "tokens_per_s": (100 * 1 + 300 * 3 + 200 * 1 + 200 * 1) / 6,
        "train_time_s": 6.0,
        "tokens": None,
        "flops": None,
    }
    assert real == {
        "stage": "real",
        "steps": (4, 5),
        "blocks": [4],
        "depths": [],
        "val_loss": 4.5,
        "tokens_per_s": 50.0,
        "train_time_s": 2.0,
        "tokens": None,
        "flops": None,
    }
    assert stage_summary([]) == []
