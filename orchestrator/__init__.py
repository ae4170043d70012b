"""Step-graph runtime (graphs, scheduler, budgets, traces, result store); arrives with the orchestrator issue."""
