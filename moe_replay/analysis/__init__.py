"""How many routed experts change: metrics (torch), tables (pandas, lazily), plots (matplotlib, `analysis.plots`)."""

from .drift import measure_mismatch, measure_update_drift, teacher_forced_routes
from .metrics import ExpertChange, expert_change

__all__ = ["ExpertChange", "expert_change", "measure_mismatch", "measure_update_drift", "teacher_forced_routes"]
