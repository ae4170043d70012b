"""thinkahead: an inference orchestrator for reasoning models and agents.

`from thinkahead import Orchestrator` is the entry point; graphs, workflows and models are one
import further (`thinkahead.orchestrator`, `thinkahead.workflows`, `thinkahead.models`).
"""

__version__ = "0.1.0"

__all__ = ["Orchestrator", "OrchestratorConfig", "RunBudget", "RunResult", "StepGraph", "__version__"]


def __getattr__(name: str):
    # the SDK pulls in pydantic and networkx: import it when first asked for, so `thinkahead --help` stays fast
    if name == "Orchestrator":
        from thinkahead.sdk import Orchestrator

        return Orchestrator
    if name == "OrchestratorConfig":
        from thinkahead.config import OrchestratorConfig

        return OrchestratorConfig
    if name in ("RunBudget", "RunResult", "StepGraph"):
        import thinkahead.orchestrator as orchestrator

        return getattr(orchestrator, name)
    raise AttributeError(name)
