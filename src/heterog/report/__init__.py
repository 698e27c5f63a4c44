"""The report stage: a Plan, its SimResult, the planner's candidates and optionally a measured
run → one self-contained HTML page (timelines, memory, placement, candidates, bottleneck)."""

from heterog.report.build import ReportInputs, build_report
from heterog.report.inputs import Candidate, PlanFile, load_plan_file, load_run

__all__ = ["ReportInputs", "build_report", "Candidate", "PlanFile", "load_plan_file", "load_run"]
