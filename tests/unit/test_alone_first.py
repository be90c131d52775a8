"""Set-up measures the master alone and holds every plan with workers to it
(master/alone_first.py, issue 50)."""
from __future__ import annotations

import pytest

from hetconv.engine.stage import layer_settings
from hetconv.master.alone_first import SETUP_BAND, first_choice, measure_alone
from hetconv.model import init_parameters, model_config, parse_network


def test_the_master_alone_wins_where_it_measured_no_slower() -> None:
    choice = first_choice(0.1632, 0.1252)  # the lab's 10 Mbit row: predicted with workers
    assert choice.alone and not choice.unsure
    assert "163.2 ms" in choice.why and "125.2 ms" in choice.why
    assert first_choice(0.100, 0.100).alone


def test_workers_within_the_models_band_are_unsure_beyond_it_sure() -> None:
    unsure = first_choice(0.100, 0.100 * (1 + SETUP_BAND) * 0.99)
    assert not unsure.alone and unsure.unsure and "the run's measured steps decide" in unsure.why
    sure = first_choice(0.0379, 0.1299)  # four 0.45-core machines at 1 Gbit
    assert not sure.alone and not sure.unsure


def test_the_probe_times_real_steps_and_leaves_the_weights_alone() -> None:
    model = model_config(parse_network("4:8"), (1, 28, 28))
    params = init_parameters(model, 0)
    before = {name: array.copy() for name, array in params.items()}
    measure = measure_alone(model, params, layer_settings(model, 0.9, 5e-4), 16, "cpu", steps=2)
    assert measure is not None and measure.steps == 2
    assert 0 < measure.conv_s <= measure.step_s and measure.dense_s >= 0
    assert all((params[name] == before[name]).all() for name in params)
    record = measure.as_record()
    assert record["alone_measured_conv_s"] == pytest.approx(measure.conv_s)


def test_a_step_the_master_cannot_hold_is_no_figure() -> None:
    model = model_config(parse_network("c4096k3p1,c4096k3p1"), (1, 28, 28))
    # the weights are not needed: the memory check comes first
    assert measure_alone(model, {}, layer_settings(model, 0.9, 5e-4), 65536, "cpu") is None
