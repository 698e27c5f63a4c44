"""Training runs of plans on local processes: one API (api.py) in three orderings — `run`,
`run_many`, `run_interleaved` — that returns RunResults (ir/run_result.py); where the ranks run
(layout.py); their results summarised beside the prediction, per instruction (summary.py);
elastic runs that re-plan when devices come and go (elastic.py), and what a run records of
the checkpoints it resumed from and saved (provenance.py)."""

from heterog.runs.api import RunOrder, run, run_interleaved, run_many, run_plans

__all__ = ["RunOrder", "run", "run_interleaved", "run_many", "run_plans"]
