"""PrecisionLossGraph: curve geometry, guards, and the saved PNG + CSV."""
from __future__ import annotations

import csv
import os

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(scope="module")
def lg(pack_module):
    return pack_module("nodes.train.loss_graph")


def test_smoothing_is_bias_corrected_ema(lg):
    assert lg.smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert lg.smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, (0.25 * 1 + 0.5 * 3) / 0.75])
    assert lg.smooth([1.0, 3.0], 0.0) == [1.0, 3.0]


def test_pixels_span_the_plot_and_higher_loss_is_higher(lg):
    values, lo, hi = lg.value_range([4.0, 2.0, 1.0], log_scale=False)
    pts = lg.to_pixels(values, lo, hi, 300, 200)
    left, top, right, bottom = lg.MARGIN
    assert pts[0] == (left, top) and pts[-1] == (300 - right, 200 - bottom)
    assert pts[1][1] > pts[0][1]  # 2.0 is drawn below 4.0


def test_log_scale_and_constant_and_single_point_guards(lg):
    values, lo, hi = lg.value_range([10.0, 1.0, 0.0], log_scale=True)
    assert values == pytest.approx([1.0, 0.0, -1.0])  # 0 clamped to a tenth of the smallest positive
    _, lo, hi = lg.value_range([0.5, 0.5], log_scale=False)
    assert lo < 0.5 < hi
    img = lg.draw_curve([0.7], 0.9, False, 200, 120)
    assert np.asarray(img).min() < 255  # something was drawn


def test_empty_or_nonfinite_history_is_a_clear_error(lg):
    with pytest.raises(ValueError, match=r"PrecisionLossGraph: input 'loss' has no finite values \(2 entries\)"):
        lg.finite_losses({"loss": [float("nan"), None]})
    with pytest.raises(ValueError, match="input 'loss' must be a LOSS_MAP"):
        lg.finite_losses([1.0])


def test_node_saves_png_and_csv_and_returns_image(lg):
    import folder_paths

    losses = [1.0, 0.8, float("nan"), 0.5, 0.45]
    out = lg.PrecisionLossGraph.execute({"loss": losses}, 0.5, True, 256, 128, "precision_lora/test_loss")
    image = out.result[0]
    assert tuple(image.shape) == (1, 128, 256, 3) and float(image.min()) < 1.0
    saved = out.ui.as_dict()["images"][0]
    path = os.path.join(folder_paths.get_output_directory(), saved["subfolder"], saved["filename"])
    assert Image.open(path).size == (256, 128)
    with open(path[:-4] + ".csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["loss"]) for r in rows] == [1.0, 0.8, 0.5, 0.45]


def test_the_csv_carries_the_validation_loss_on_the_steps_that_measured_it(lg):
    import folder_paths

    out = lg.PrecisionLossGraph.execute({"loss": [1.0, 0.8, 0.6, 0.5], "val_loss": [[2, 0.9], [4, 0.7]]}, 0.5, False,
                                        256, 128, "precision_lora/test_val_loss")
    saved = out.ui.as_dict()["images"][0]
    path = os.path.join(folder_paths.get_output_directory(), saved["subfolder"], saved["filename"])
    with open(path[:-4] + ".csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["val_loss"]) for r in rows] == [("1", ""), ("2", "0.9"), ("3", ""), ("4", "0.7")]
