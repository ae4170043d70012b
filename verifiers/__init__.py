"""Verifiers: step verifiers (`base.StepVerifier`: `judge`, `agreement`, `likelihood`), Arbitrage routers
(`router`, `router_features`, `router_pairs`), answer grading (`grading`) and the code sandbox (`sandbox`)."""
