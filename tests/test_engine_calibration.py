"""The shipped CPU-overhead defaults are a linear fit of Vidur's measured per-iteration CPU overheads."""

import numpy as np
import pandas as pd
import pytest

from lab.experiment.config import CPUOverheadConfig
from tests.conftest import DATA_DIR, needs_data

CSV = ("calibration", "vidur", "historical_acb95f6", "a100", "cpu_overheads.csv")


@needs_data(*CSV)
def test_cpu_overhead_defaults_refit_from_vidur_measurements():
    d = pd.read_csv(DATA_DIR.joinpath(*CSV))
    per_step_ms = d.schedule_mean + d.sampler_e2e_mean + d.prepare_inputs_e2e_mean + d.process_model_outputs_mean
    slope, intercept = np.polyfit(d.batch_size, per_step_ms, 1)
    c = CPUOverheadConfig()
    assert c.base_s == pytest.approx(intercept / 1000, rel=0.01)
    assert c.per_seq_s == pytest.approx(slope / 1000, rel=0.01)
