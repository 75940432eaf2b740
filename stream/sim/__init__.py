"""The fleet simulator and capacity tuning: the affinity signal scored against the truth.

Both reuse the pure core (``stream.core``), so what they measure is what the service
does. ``stream.sim.encoder`` models a vLLM v1 encoder cache (the truth),
``stream.sim.workload`` draws or reads the requests, ``stream.sim.fleet`` routes them
under each policy, ``stream.sim.tune`` replays recorded placements under a range of
capacities, ``stream.sim.commands`` adds ``simulate``, ``tune`` and ``export`` to the CLI.
"""
