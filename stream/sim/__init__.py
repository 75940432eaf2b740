"""The fleet simulator and capacity tuning: the affinity signal scored against the truth.

Both reuse the pure core (``stream.core``), so what they measure is what the service
does. One server is ``stream.sim.engine`` (vLLM v1's scheduler with its three cache
layers: ``stream.sim.processor``, ``stream.sim.encoder``, ``stream.sim.prefix``);
``stream.sim.workload`` draws prompts with structure (a shared system prompt, shared and
fresh items, conversations) or reads them from a trace; ``stream.sim.fleet`` routes them
under each policy behind gateway replicas that see a scraped load; ``stream.sim.load``
measures the fleet's capacity and which policy wins on TTFT p90 by load;
``stream.sim.tune`` replays recorded placements under a range of capacities against the
processor and encoder layers; ``stream.sim.commands`` adds ``simulate``, ``tune`` and
``export`` to the CLI.
"""
