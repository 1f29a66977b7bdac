"""The trainer's config, `TrainConfig` and its errors: defined in `linattn.train_config` (so that
`linattn.checkpoint` can import the schema without importing the trainer) and re-exported here."""
from __future__ import annotations

from ..train_config import (  # noqa: F401  (re-exported)
    DTYPE_ALIASES,
    DTYPES,
    PARALLEL,
    TRAJECTORY_FIELDS,
    TrainConfig,
    TrainConfigError,
    TrainError,
    TrainingDiverged,
    check_resume_compatible,
    legacy_values,
    resolve_device,
)

__all__ = ["TrainConfig", "TrainError", "TrainConfigError", "TrainingDiverged", "legacy_values", "TRAJECTORY_FIELDS",
           "DTYPES", "PARALLEL", "check_resume_compatible", "resolve_device"]
