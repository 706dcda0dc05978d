"""The planner (pure numpy): the plan space, the cost model, the search and the report.

``plan()`` ranks every valid plan of the contract; ``estimate()`` prices one. See ARCHITECTURE.md.
"""

from lightning_autopar.planner.report import PlanReport
from lightning_autopar.planner.search import estimate, plan

__all__ = ["PlanReport", "estimate", "plan"]
